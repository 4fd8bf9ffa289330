//! When the runtime snapshots an in-memory machine.
//!
//! A snapshot costs a pass over the whole state, so taking one every N
//! entries makes the cost per write grow with the state's size: a large
//! state with small writes would spend most of its time snapshotting. The
//! policy here snapshots when the log written since the last snapshot holds
//! at least as many bytes as that snapshot did (with a floor, so that a
//! small state is not snapshotted after every write). Each snapshot's cost
//! is then paid for by at least as many bytes of log, and the log's size on
//! disk stays within about twice the state's.

/// When to snapshot an in-memory machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotPolicy {
    /// Never snapshot before the log since the last snapshot holds this
    /// many bytes of commands.
    pub log_bytes_min: u64,
    /// Snapshot once the log since the last snapshot holds at least this
    /// many times the last snapshot's size, in percent (100: as many bytes
    /// as the snapshot).
    pub log_to_snapshot_percent: u64,
    /// Also snapshot once this many commands were applied since the last
    /// snapshot, however few bytes they hold (etcd's `--snapshot-count`).
    /// Off by default: with it, the snapshot cost per write grows with the
    /// state's size again.
    pub entries_max: Option<u64>,
}

impl Default for SnapshotPolicy {
    fn default() -> Self {
        SnapshotPolicy {
            log_bytes_min: 4 << 20,
            log_to_snapshot_percent: 100,
            entries_max: None,
        }
    }
}

impl SnapshotPolicy {
    /// Whether a snapshot is due, with `log_entries` commands holding
    /// `log_bytes` applied since the last one, which was `snapshot_bytes`
    /// large (0 if none yet).
    pub fn due(&self, log_entries: u64, log_bytes: u64, snapshot_bytes: u64) -> bool {
        let proportional = snapshot_bytes.saturating_mul(self.log_to_snapshot_percent) / 100;
        log_bytes >= self.log_bytes_min.max(proportional)
            || self.entries_max.is_some_and(|max| log_entries >= max)
    }
}

#[cfg(test)]
mod tests {
    use super::SnapshotPolicy;

    #[test]
    fn a_snapshot_waits_for_the_floor_then_for_as_many_bytes_as_the_last() {
        let policy = SnapshotPolicy {
            log_bytes_min: 1000,
            log_to_snapshot_percent: 100,
            entries_max: None,
        };
        assert!(!policy.due(5, 999, 0));
        assert!(policy.due(5, 1000, 0));
        // A large state: the log must grow as large before the next one.
        assert!(!policy.due(50_000, 1_000_000, 5_000_000));
        assert!(policy.due(50_000, 5_000_000, 5_000_000));
        // No overflow at the limits.
        assert!(policy.due(u64::MAX, u64::MAX, u64::MAX));
        // A count of entries, if asked for, is enough on its own.
        let counted = SnapshotPolicy {
            entries_max: Some(100),
            ..policy
        };
        assert!(!counted.due(99, 10, 5_000_000));
        assert!(counted.due(100, 10, 5_000_000));
    }
}
