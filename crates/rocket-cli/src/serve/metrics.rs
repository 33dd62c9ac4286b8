//! `GET /metrics`: Prometheus text format (0.0.4) via `prometheus-client`.
//!
//! Request and token counts and the latency histograms are recorded as
//! requests go; the gauges (queue, running batch, KV bytes, decode path) and the
//! backend's counters are read from the scheduler and engine at each scrape,
//! from atomics that never wait on a forward pass (the prefix cache's numbers
//! behind its lock, which is held for a lookup or a KV copy, never a pass).

use std::sync::Mutex;

use prometheus_client::encoding::{prometheus_text, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use super::Ready;

pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: String,
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    batch: &'static str,
    sampling: &'static str,
    path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
}

pub struct ServerMetrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    ttft: Histogram,
    inter_token: Histogram,
    queue_depth: Gauge,
    running: Gauge,
    kv_bytes: Gauge,
    decode_path: Family<PathLabels, Gauge>,
    megakernel_launches: Counter,
    watchdog_events: Counter,
    prefix_lookups: Counter,
    prefix_hits: Counter,
    prefix_reused_tokens: Counter,
    prefix_evictions: Counter,
    prefix_bytes: Gauge,
    prefix_entries: Gauge,
    device_in_service: Family<DeviceLabels, Gauge>,
    device_running: Family<DeviceLabels, Gauge>,
    device_queue_depth: Family<DeviceLabels, Gauge>,
    device_queued_prompt_tokens: Family<DeviceLabels, Gauge>,
    /// One scrape at a time: refreshing the read-at-scrape values is not atomic.
    scrape: Mutex<()>,
}

impl ServerMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("rocket");
        let m = ServerMetrics {
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            // 1 ms .. 33 s and 0.1 ms .. 3.3 s: GPU decode steps are under a millisecond.
            ttft: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            inter_token: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            queue_depth: Gauge::default(),
            running: Gauge::default(),
            kv_bytes: Gauge::default(),
            decode_path: Family::default(),
            megakernel_launches: Counter::default(),
            watchdog_events: Counter::default(),
            prefix_lookups: Counter::default(),
            prefix_hits: Counter::default(),
            prefix_reused_tokens: Counter::default(),
            prefix_evictions: Counter::default(),
            prefix_bytes: Gauge::default(),
            prefix_entries: Gauge::default(),
            device_in_service: Family::default(),
            device_running: Family::default(),
            device_queue_depth: Family::default(),
            device_queued_prompt_tokens: Family::default(),
            scrape: Mutex::new(()),
            registry: Registry::default(),
        };
        registry.register("requests", "HTTP requests answered, by route and status code", m.requests.clone());
        registry.register("prompt_tokens", "Prompt tokens of requests handed to the scheduler", m.prompt_tokens.clone());
        registry.register("generation_tokens", "Tokens generated (completion_tokens, cancelled requests included)", m.generation_tokens.clone());
        registry.register_with_unit("time_to_first_token", "Time from a request's arrival to its first generated token", Unit::Seconds, m.ttft.clone());
        registry.register_with_unit("inter_token_latency", "Time between consecutive generated tokens of a request", Unit::Seconds, m.inter_token.clone());
        registry.register("queue_depth", "Admitted requests waiting for a place in the running batch", m.queue_depth.clone());
        registry.register("running_requests", "Requests in the running batch", m.running.clone());
        registry.register_with_unit("kv_cache_usage", "Memory held by the KV caches of running requests", Unit::Bytes, m.kv_bytes.clone());
        registry.register("decode_path_info", "How a decode step runs, by batch shape (value 1)", m.decode_path.clone());
        registry.register("megakernel_launches", "Megakernel token-loop launches", m.megakernel_launches.clone());
        registry.register("megakernel_watchdog_events", "Megakernel launches ended by its watchdog (then decoding falls back to CUDA graphs)", m.watchdog_events.clone());
        registry.register("prefix_cache_lookups", "Prompts looked up in the prefix cache", m.prefix_lookups.clone());
        registry.register("prefix_cache_hits", "Prompts that reused cached KV of an earlier prompt's whole blocks", m.prefix_hits.clone());
        registry.register("prefix_cache_reused_tokens", "Prompt tokens whose prefill was skipped by prefix reuse", m.prefix_reused_tokens.clone());
        registry.register("prefix_cache_evictions", "Cached prefixes dropped to stay within the budget or to make room", m.prefix_evictions.clone());
        registry.register_with_unit("prefix_cache_usage", "Memory held by the prefix cache (at most --prefix-cache-bytes)", Unit::Bytes, m.prefix_bytes.clone());
        registry.register("prefix_cache_entries", "Cached prompt prefixes", m.prefix_entries.clone());
        registry.register("device_in_service", "Whether a device's engine takes requests (0 once it failed)", m.device_in_service.clone());
        registry.register("device_running_requests", "Requests in a device's running batch", m.device_running.clone());
        registry.register("device_queue_depth", "Admitted requests waiting on a device", m.device_queue_depth.clone());
        registry.register("device_queued_prompt_tokens", "Prompt tokens of a device's requests that have not produced a token yet", m.device_queued_prompt_tokens.clone());
        ServerMetrics { registry, ..m }
    }

    /// One answered request; `endpoint` is the route pattern (bounded label values).
    pub fn count_request(&self, endpoint: &str, status: u16) {
        self.requests.get_or_create(&RequestLabels { endpoint: endpoint.to_string(), status: status.to_string() }).inc();
    }

    pub fn add_prompt_tokens(&self, n: usize) {
        self.prompt_tokens.inc_by(n as u64);
    }

    pub fn add_generation_tokens(&self, n: usize) {
        self.generation_tokens.inc_by(n as u64);
    }

    pub fn observe_ttft(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    pub fn observe_inter_token(&self, seconds: f64) {
        self.inter_token.observe(seconds);
    }

    /// The text exposition, with the scheduler's and backend's current values.
    pub fn render(&self, ready: Option<&Ready>) -> String {
        let _one = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = ready {
            let s = &r.router;
            let running = s.running();
            self.running.set(running as i64);
            self.queue_depth.set(s.in_flight().saturating_sub(running) as i64);
            self.kv_bytes.set(s.kv_bytes() as i64);
            for d in s.loads() {
                let device = DeviceLabels { device: d.name.clone() };
                self.device_in_service.get_or_create(&device).set(d.in_service as i64);
                self.device_running.get_or_create(&device).set(d.running as i64);
                self.device_queue_depth.get_or_create(&device).set(d.in_flight.saturating_sub(d.running) as i64);
                self.device_queued_prompt_tokens.get_or_create(&device).set(d.queued_prompt_tokens as i64);
            }
            // Summed over the engines; each engine's counters only grow: add what is new since the last scrape.
            let (launches, watchdog) = (0..s.len()).map(|i| s.scheduler(i).engine().backend_counters()).fold((0, 0), |(l, w), c| (l + c.megakernel_launches, w + c.watchdog_events));
            self.megakernel_launches.inc_by(launches.saturating_sub(self.megakernel_launches.get()));
            self.watchdog_events.inc_by(watchdog.saturating_sub(self.watchdog_events.get()));
            let pc = s.prefix_cache_stats();
            for (counter, now) in [
                (&self.prefix_lookups, pc.lookups),
                (&self.prefix_hits, pc.hits),
                (&self.prefix_reused_tokens, pc.tokens_reused),
                (&self.prefix_evictions, pc.evictions),
            ] {
                counter.inc_by(now.saturating_sub(counter.get()));
            }
            self.prefix_bytes.set(pc.bytes as i64);
            self.prefix_entries.set(pc.entries as i64);
            // The first engine's paths stand for all: every device loads the same model with the same options.
            let p = s.scheduler(0).decode_paths();
            self.decode_path.clear();
            for (batch, sampling, path) in
                [("1", "greedy", p.single_greedy), ("1", "sampled", p.single_sampled), (">1", "greedy", p.batch_greedy), (">1", "sampled", p.batch_sampled)]
            {
                self.decode_path.get_or_create(&PathLabels { batch, sampling, path }).set(1);
            }
        }
        let mut text = String::new();
        prometheus_text::encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_prometheus_conventions() {
        let m = ServerMetrics::new();
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 401);
        m.add_prompt_tokens(7);
        m.add_generation_tokens(5);
        m.observe_ttft(0.003);
        m.observe_inter_token(0.0002);
        let text = m.render(None);
        for want in [
            "# TYPE rocket_requests_total counter",
            "rocket_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2",
            "rocket_requests_total{endpoint=\"/v1/completions\",status=\"401\"} 1",
            "rocket_prompt_tokens_total 7",
            "rocket_generation_tokens_total 5",
            "# TYPE rocket_time_to_first_token_seconds histogram",
            "rocket_time_to_first_token_seconds_bucket{le=\"0.004\"} 1",
            "rocket_time_to_first_token_seconds_count 1",
            "rocket_inter_token_latency_seconds_bucket{le=\"0.0002\"} 1",
            "rocket_queue_depth 0",
            "rocket_running_requests 0",
            "rocket_kv_cache_usage_bytes 0",
            "rocket_megakernel_launches_total 0",
            "rocket_megakernel_watchdog_events_total 0",
            "rocket_prefix_cache_lookups_total 0",
            "rocket_prefix_cache_hits_total 0",
            "rocket_prefix_cache_reused_tokens_total 0",
            "rocket_prefix_cache_evictions_total 0",
            "rocket_prefix_cache_usage_bytes 0",
            "rocket_prefix_cache_entries 0",
        ] {
            assert!(text.lines().any(|l| l == want), "no line {want:?} in\n{text}");
        }
    }
}
