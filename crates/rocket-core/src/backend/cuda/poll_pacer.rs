//! When the host looks at the megakernel's token ring next. Each look costs
//! the host a driver query and a wake-up, and a look between two tokens finds
//! nothing: so after a token the host sleeps through most of a token's time
//! (the loop's own pace, learnt from the tokens it has seen), then looks every
//! `STEP` until the next one lands. A token is seen at most `STEP` after it
//! lands once the pace is known, as with a fixed `STEP` poll. Where the launch
//! is about to end, the caller polls at `STEP` instead (the GPU waits for the
//! next launch meanwhile).

use std::time::{Duration, Instant};

/// The fine poll, and before the loop's pace is known.
pub(crate) const STEP: Duration = Duration::from_micros(50);
/// The longest sleep after a token: a slow step (a long context, a busy GPU)
/// should not leave the host's stop flag unread for long.
const MAX_SLEEP: Duration = Duration::from_millis(5);

#[derive(Debug, Default)]
pub(crate) struct PollPacer {
    /// Time per token, a moving average over the tokens seen.
    per_token: Option<Duration>,
    last_token: Option<Instant>,
}

impl PollPacer {
    /// `n` tokens (n >= 1) were seen at `now`.
    pub(crate) fn saw(&mut self, now: Instant, n: usize) {
        if let Some(last) = self.last_token {
            let per = now.saturating_duration_since(last) / u32::try_from(n).unwrap_or(u32::MAX).max(1);
            self.per_token = Some(match self.per_token {
                Some(avg) => (avg * 3 + per) / 4,
                None => per,
            });
        }
        self.last_token = Some(now);
    }

    /// How long to sleep before the next look, at `now`: until three quarters
    /// of a token's time after the last one (at most `MAX_SLEEP`), else `STEP`.
    pub(crate) fn sleep(&self, now: Instant) -> Duration {
        let (Some(per), Some(last)) = (self.per_token, self.last_token) else {
            return STEP;
        };
        let wake = last + (per * 3 / 4).min(MAX_SLEEP);
        wake.saturating_duration_since(now).max(STEP)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_sleeps_through_most_of_a_token_once_it_knows_the_pace() {
        let t0 = Instant::now();
        let us = |n: u64| Duration::from_micros(n);
        let mut p = PollPacer::default();
        assert_eq!(p.sleep(t0), STEP); // nothing seen
        p.saw(t0, 1);
        assert_eq!(p.sleep(t0), STEP); // one token: no pace yet
        p.saw(t0 + us(1000), 1);
        assert_eq!(p.sleep(t0 + us(1000)), us(750));
        // Later in the gap, only what is left of it; past it, the fine poll.
        assert_eq!(p.sleep(t0 + us(1500)), us(250));
        assert_eq!(p.sleep(t0 + us(1740)), STEP);
        assert_eq!(p.sleep(t0 + us(1900)), STEP);
        // Two tokens at one look count as two: 1,000 µs each here.
        p.saw(t0 + us(3000), 2);
        assert_eq!(p.sleep(t0 + us(3000)), us(750));
        // The pace moves a quarter of the way to a new one: 1,000 -> 1,250 µs.
        p.saw(t0 + us(5000), 1);
        assert_eq!(p.sleep(t0 + us(5000)), Duration::from_nanos(937_500));
        // A slow step never makes the host sleep past MAX_SLEEP.
        let mut slow = PollPacer::default();
        slow.saw(t0, 1);
        slow.saw(t0 + Duration::from_secs(1), 1);
        assert_eq!(slow.sleep(t0 + Duration::from_secs(1)), MAX_SLEEP);
    }
}
