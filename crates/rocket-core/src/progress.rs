//! A progress bar for model loads: drawn on stderr only when stderr is a
//! terminal and the load has already taken more than a second, so quick loads
//! and logs stay clean. Safe to advance from many threads.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::options::Progress;

/// Loads faster than this never show a bar.
const SHOW_AFTER: Duration = Duration::from_secs(1);

pub struct LoadProgress {
    enabled: bool,
    show_after: Duration,
    started: Instant,
    /// The bar counts bytes; hidden until `SHOW_AFTER` has passed.
    bar: ProgressBar,
    shown: OnceLock<()>,
}

impl LoadProgress {
    /// `Progress::Off` never draws (embedding, tests); `Always` draws from the
    /// start (still only on a terminal).
    pub fn new(setting: Progress) -> Self {
        let show_after = if setting == Progress::Always { Duration::ZERO } else { SHOW_AFTER };
        LoadProgress {
            enabled: setting != Progress::Off,
            show_after,
            started: Instant::now(),
            bar: ProgressBar::hidden(),
            shown: OnceLock::new(),
        }
    }

    /// Starts a phase of `total` bytes (e.g. "dequantizing", "uploading").
    pub fn phase(&self, message: &'static str, total: u64) {
        self.bar.set_message(message);
        self.bar.set_length(total);
        self.bar.set_position(0);
        self.maybe_show();
    }

    pub fn advance(&self, bytes: u64) {
        self.bar.inc(bytes);
        self.maybe_show();
    }

    pub fn finish(&self) {
        if self.shown.get().is_some() {
            self.bar.finish_and_clear();
        }
    }

    fn maybe_show(&self) {
        if !self.enabled || self.shown.get().is_some() || self.started.elapsed() < self.show_after {
            return;
        }
        self.shown.get_or_init(|| {
            // indicatif itself draws nothing when stderr is not a terminal.
            let style = ProgressStyle::with_template("{msg:>12} [{bar:30}] {binary_bytes}/{binary_total_bytes} {eta}")
                .expect("valid template")
                .progress_chars("=> ");
            self.bar.set_style(style);
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
        });
    }
}

impl Drop for LoadProgress {
    fn drop(&mut self) {
        self.finish();
    }
}
