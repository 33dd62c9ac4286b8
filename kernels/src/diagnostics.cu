// The diagnostics module: probes of the hardware the megakernel is built on,
// compiled apart from rocket.cu so the shipped image carries none of them. Only
// rocket-core's `diagnostics` feature embeds and loads it (backend/cuda/probe.rs).
#include "stream_probe.cu"
#include "latency_probe.cu"
#include "handoff_probe.cu"
