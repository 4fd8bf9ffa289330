//! Rate limits for warnings that a peer or a client can trigger at will.
//!
//! A warning logged once per bad frame or per refused connection lets
//! whoever sends them fill the disk with the log (a stream of undecodable
//! frames once wrote 775 MB of log in 10 s). Such a warning goes through a
//! [`LogLimiter`]: a few are written per window, the rest are counted, and
//! the next one written says how many were left out.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Warnings of one kind written per window before the rest are counted.
pub const WARNINGS_PER_WINDOW: u32 = 5;
/// The window over which [`WARNINGS_PER_WINDOW`] apply.
pub const WARNING_WINDOW: Duration = Duration::from_secs(10);

/// Lets through at most `per_window` reports of one kind per `window`.
#[derive(Debug)]
pub struct LogLimiter {
    per_window: u32,
    window: Duration,
    window_start: Option<Instant>,
    written_in_window: u32,
    /// Reports left out since the last one let through.
    suppressed: u64,
}

impl LogLimiter {
    /// A limiter letting `per_window` reports through per `window`.
    pub const fn new(per_window: u32, window: Duration) -> LogLimiter {
        LogLimiter {
            per_window,
            window,
            window_start: None,
            written_in_window: 0,
            suppressed: 0,
        }
    }

    /// The limiter used for warnings a remote party can cause:
    /// [`WARNINGS_PER_WINDOW`] per [`WARNING_WINDOW`].
    pub const fn for_remote_input() -> LogLimiter {
        LogLimiter::new(WARNINGS_PER_WINDOW, WARNING_WINDOW)
    }

    /// Whether a report may be written now: `Some(n)` with the number of
    /// reports left out since the last one written, or `None` to leave
    /// this one out.
    pub fn allow(&mut self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    /// [`LogLimiter::allow`] at a given moment (for tests).
    pub fn allow_at(&mut self, now: Instant) -> Option<u64> {
        let expired = self
            .window_start
            .is_none_or(|start| now.saturating_duration_since(start) >= self.window);
        if expired {
            self.window_start = Some(now);
            self.written_in_window = 0;
        }
        if self.written_in_window >= self.per_window {
            self.suppressed = self.suppressed.saturating_add(1);
            return None;
        }
        self.written_in_window += 1;
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// A [`LogLimiter`] shared by tasks (the connections of one listener).
#[derive(Debug)]
pub struct SharedLogLimiter(Mutex<LogLimiter>);

impl SharedLogLimiter {
    /// A shared [`LogLimiter::for_remote_input`].
    pub const fn for_remote_input() -> SharedLogLimiter {
        SharedLogLimiter(Mutex::new(LogLimiter::for_remote_input()))
    }

    /// See [`LogLimiter::allow`].
    pub fn allow(&self) -> Option<u64> {
        // A panic while holding this lock cannot leave the counters in a
        // state worse than a miscount.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .allow()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_reports_writes_a_few_per_window_and_counts_the_rest() {
        let mut limiter = LogLimiter::new(5, Duration::from_secs(10));
        let start = Instant::now();
        let mut written = Vec::new();
        // 10 000 reports over 30 s: three windows.
        for i in 0..10_000u64 {
            let now = start + Duration::from_millis(i * 3);
            if let Some(suppressed) = limiter.allow_at(now) {
                written.push(suppressed);
            }
        }
        assert_eq!(written.len(), 15, "{written:?}");
        // The first report of each later window tells how many were left out.
        assert_eq!(written[0], 0);
        assert!(written[5] > 3000, "{written:?}");
        // Every report is written or counted: those of the last window
        // are told with the next one written.
        let counted: u64 = written.iter().sum::<u64>() + written.len() as u64;
        assert_eq!(counted + limiter.suppressed, 10_000);
    }

    #[test]
    fn a_quiet_source_is_never_held_back() {
        let mut limiter = LogLimiter::for_remote_input();
        let start = Instant::now();
        for i in 0..100u64 {
            assert_eq!(
                limiter.allow_at(start + WARNING_WINDOW * (i as u32)),
                Some(0)
            );
        }
    }
}
