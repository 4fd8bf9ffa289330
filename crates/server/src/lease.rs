//! Lease deadlines on the leader's clock.
//!
//! Which leases exist is replicated state (`KvState::leases`); when they run
//! out is not: only the leader's clock decides, and it proposes a
//! `LeaseExpire` command that every replica applies the same way. A node
//! that becomes leader calls [`LeaseClock::reset`], which gives every lease
//! its full TTL again, so that a leader change never expires a lease early.
//! Time is a plain millisecond count the runtime passes in, which keeps this
//! module deterministic and testable.

use std::collections::BTreeMap;

use crate::command::{command, CommandKind, LeaseExpireCommand};
use crate::kv_state::LeaseRecord;
use crate::pb::ferrypb::Command;

/// Deadlines of the leases this node knows, in milliseconds of its clock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseClock {
    deadline_ms: BTreeMap<i64, u64>,
}

impl LeaseClock {
    /// A clock that knows no lease yet.
    pub fn new() -> LeaseClock {
        LeaseClock::default()
    }

    /// Forgets every deadline; each lease gets its full TTL from the next
    /// [`LeaseClock::sync`]. Called when this node becomes leader.
    pub fn reset(&mut self) {
        self.deadline_ms.clear();
    }

    /// Starts the clock of leases it has not seen (they get their full TTL
    /// from `now_ms`) and drops the ones that no longer exist.
    pub fn sync(&mut self, leases: &BTreeMap<i64, LeaseRecord>, now_ms: u64) {
        self.deadline_ms.retain(|id, _| leases.contains_key(id));
        for (id, record) in leases {
            self.deadline_ms
                .entry(*id)
                .or_insert_with(|| deadline(now_ms, record.granted_ttl_seconds));
        }
    }

    /// Renews a lease to its full TTL; returns that TTL, or `None` for an
    /// unknown lease.
    pub fn keep_alive(
        &mut self,
        leases: &BTreeMap<i64, LeaseRecord>,
        id: i64,
        now_ms: u64,
    ) -> Option<i64> {
        let record = leases.get(&id)?;
        self.deadline_ms
            .insert(id, deadline(now_ms, record.granted_ttl_seconds));
        Some(record.granted_ttl_seconds)
    }

    /// Seconds left on a lease, rounded up; `None` for an unknown lease.
    pub fn remaining_seconds(
        &mut self,
        leases: &BTreeMap<i64, LeaseRecord>,
        id: i64,
        now_ms: u64,
    ) -> Option<i64> {
        let record = leases.get(&id)?;
        let deadline_ms = *self
            .deadline_ms
            .entry(id)
            .or_insert_with(|| deadline(now_ms, record.granted_ttl_seconds));
        let left_ms = deadline_ms.saturating_sub(now_ms);
        Some(i64::try_from(left_ms.div_ceil(1000)).unwrap_or(i64::MAX))
    }

    /// Leases whose deadline has passed, at most `ids_max` of them, oldest
    /// deadline first, as one command to propose. `None` when none expired.
    pub fn expired(
        &mut self,
        leases: &BTreeMap<i64, LeaseRecord>,
        now_ms: u64,
        ids_max: usize,
    ) -> Option<Command> {
        self.sync(leases, now_ms);
        let mut due: Vec<(u64, i64)> = self
            .deadline_ms
            .iter()
            .filter(|(_, deadline_ms)| **deadline_ms <= now_ms)
            .map(|(id, deadline_ms)| (*deadline_ms, *id))
            .collect();
        if due.is_empty() {
            return None;
        }
        due.sort_unstable();
        due.truncate(ids_max);
        let ids = due.into_iter().map(|(_, id)| id).collect();
        Some(command(CommandKind::LeaseExpire(LeaseExpireCommand {
            ids,
        })))
    }
}

fn deadline(now_ms: u64, ttl_seconds: i64) -> u64 {
    let ttl_ms = u64::try_from(ttl_seconds).unwrap_or(0).saturating_mul(1000);
    now_ms.saturating_add(ttl_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leases(entries: &[(i64, i64)]) -> BTreeMap<i64, LeaseRecord> {
        entries
            .iter()
            .map(|(id, ttl)| {
                (
                    *id,
                    LeaseRecord {
                        granted_ttl_seconds: *ttl,
                        keys: Default::default(),
                    },
                )
            })
            .collect()
    }

    fn expired_ids(command: Option<Command>) -> Vec<i64> {
        match command.and_then(|c| c.kind) {
            Some(CommandKind::LeaseExpire(e)) => e.ids,
            None => Vec::new(),
            Some(other) => panic!("unexpected command {other:?}"),
        }
    }

    #[test]
    fn expires_after_ttl_and_keep_alive_extends() {
        let known = leases(&[(1, 5), (2, 10)]);
        let mut clock = LeaseClock::new();
        clock.sync(&known, 0);
        assert_eq!(
            expired_ids(clock.expired(&known, 4_999, 10)),
            Vec::<i64>::new()
        );
        assert_eq!(clock.keep_alive(&known, 1, 4_000), Some(5));
        assert_eq!(clock.remaining_seconds(&known, 1, 4_000), Some(5));
        assert_eq!(clock.remaining_seconds(&known, 2, 4_000), Some(6));
        assert_eq!(
            expired_ids(clock.expired(&known, 8_999, 10)),
            Vec::<i64>::new()
        );
        assert_eq!(expired_ids(clock.expired(&known, 9_000, 10)), vec![1]);
        assert_eq!(expired_ids(clock.expired(&known, 10_000, 10)), vec![1, 2]);
        assert_eq!(expired_ids(clock.expired(&known, 10_000, 1)), vec![1]);
        assert_eq!(clock.keep_alive(&known, 3, 0), None);
        assert_eq!(clock.remaining_seconds(&known, 3, 0), None);
    }

    #[test]
    fn reset_gives_full_ttl_to_a_new_leader() {
        let known = leases(&[(1, 5)]);
        let mut clock = LeaseClock::new();
        clock.sync(&known, 0);
        clock.reset();
        assert_eq!(
            expired_ids(clock.expired(&known, 6_000, 10)),
            Vec::<i64>::new()
        );
        assert_eq!(clock.remaining_seconds(&known, 1, 6_000), Some(5));
        assert_eq!(expired_ids(clock.expired(&known, 11_000, 10)), vec![1]);
    }

    #[test]
    fn revoked_leases_are_forgotten() {
        let mut known = leases(&[(1, 5)]);
        let mut clock = LeaseClock::new();
        clock.sync(&known, 0);
        known.clear();
        assert_eq!(
            expired_ids(clock.expired(&known, 60_000, 10)),
            Vec::<i64>::new()
        );
    }
}
