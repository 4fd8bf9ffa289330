//! Coverage counters: what a seed exercised. A run sums them over its seeds
//! as "in how many seeds did this happen"; a counter that stays at zero over
//! many seeds marks a fault or an edge the simulator fails to reach.

use std::fmt;

macro_rules! counters {
    (
        $($(#[doc = $doc:literal])* $name:ident => $label:literal,)*
        @multi_group {
            $($(#[doc = $mdoc:literal])* $mname:ident => $mlabel:literal,)*
        }
    ) => {
        /// One thing a seed may exercise.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Counter {
            $($(#[doc = $doc])* $name,)*
            $($(#[doc = $mdoc])* $mname,)*
        }

        impl Counter {
            /// Every counter a run of one group per node can reach, in
            /// report order. (The multi-group ones are apart, so that the
            /// summaries of one-group runs read as they always did.)
            pub const ALL: &'static [Counter] = &[$(Counter::$name,)*];

            /// The counters only runs of several groups per node reach.
            pub const MULTI_GROUP: &'static [Counter] = &[$(Counter::$mname,)*];

            /// How many counters there are, of both kinds.
            pub const COUNT: usize = Self::ALL.len() + Self::MULTI_GROUP.len();

            /// The counter's name in summaries.
            pub fn label(self) -> &'static str {
                match self {
                    $(Counter::$name => $label,)*
                    $(Counter::$mname => $mlabel,)*
                }
            }
        }
    };
}

counters! {
    /// A follower installed a snapshot from the leader.
    SnapshotInstalled => "snapshot_installed",
    /// A client request arrived at a node while it was receiving a snapshot.
    RequestWhileReceivingSnapshot => "request_while_receiving_snapshot",
    /// A follower reported a snapshot as stale.
    StaleSnapshot => "stale_snapshot",
    /// A follower rejected a snapshot transfer.
    SnapshotRejected => "snapshot_rejected",
    /// The leader asked for a snapshot that was gone and had to start over.
    SnapshotChunkGone => "snapshot_chunk_gone",
    /// A leader loaded evicted entries from storage for a follower.
    EntriesLoadedFromStorage => "entries_loaded_from_storage",
    /// An entry load failed (answered None) or its answer was lost.
    EntriesLoadFailed => "entries_load_failed",
    /// A node's state machine took a snapshot.
    LocalSnapshotTaken => "local_snapshot_taken",
    /// A follower rejected an append with hint term 0.
    RejectHintTermZero => "reject_hint_term_zero",
    /// A new leader was elected.
    LeaderElected => "leader_elected",
    /// A leader was elected while a membership change was in progress.
    LeaderChangedDuringMembershipChange => "leader_changed_during_membership_change",
    /// A partition healed.
    PartitionHealed => "partition_healed",
    /// A one-way partition was in force.
    OneWayPartition => "one_way_partition",
    /// A paused node resumed.
    PausedNodeResumed => "paused_node_resumed",
    /// A node crashed and restarted.
    CrashRestart => "crash_restart",
    /// A crash lost writes that were not synced.
    UnsyncedWritesLost => "unsynced_writes_lost",
    /// A message was lost at random.
    MessageDropped => "message_dropped",
    /// A message was delivered twice.
    MessageDuplicated => "message_duplicated",
    /// A message was lost while its link was being set up.
    ConnectWindowLoss => "connect_window_loss",
    /// A clogged link healed and released what it held.
    LinkClogHealed => "link_clog_healed",
    /// A node's clock jumped ahead by a burst of ticks.
    ClockJump => "clock_jump",
    /// A learner was added.
    LearnerAdded => "learner_added",
    /// A learner was promoted to voter.
    LearnerPromoted => "learner_promoted",
    /// A voter was removed.
    VoterRemoved => "voter_removed",
    /// A node learned it was removed.
    NodeRemoved => "node_removed",
    /// A node held a joint configuration.
    JointConfig => "joint_config",
    /// Leadership passed to the node a transfer named.
    LeadershipTransferred => "leadership_transferred",
    /// A proposal was overwritten by another term's entry (definitely lost).
    ProposalLost => "proposal_lost",
    /// A proposal's outcome was learned from the session table after a snapshot skipped it.
    OutcomeFromSnapshot => "outcome_from_snapshot",
    /// A client operation succeeded.
    ClientOk => "client_ok",
    /// A client operation definitely failed.
    ClientFail => "client_fail",
    /// A client operation's outcome is unknown.
    ClientUnknown => "client_unknown",
    /// A client retried after a definite refusal.
    ClientRetry => "client_retry",
    /// A compare-and-set found another value.
    CasCompareFailed => "cas_compare_failed",
    /// A linearizable read returned a value.
    ReadOk => "read_ok",
    /// A read served under the leader's lease returned a value.
    LeaseReadOk => "lease_read_ok",
    /// A paused node's inbox overflowed and dropped messages.
    InboxOverflow => "inbox_overflow",
    /// The nodes ran on the real storage code over a simulated disk.
    RealStorageRun => "real_storage_run",
    /// A real-storage crash lost writes that were not synced.
    DiskUnsyncedLost => "disk_unsynced_lost",
    /// Recovery cut a torn tail off the log.
    TornTailCut => "torn_tail_cut",
    /// The disk lost power in the middle of a write.
    PowerLossMidWrite => "power_loss_mid_write",
    /// A sync took long (at least two ticks).
    SlowSync => "slow_sync",
    /// A sync failed: the storage poisoned itself and the node stopped.
    FailedSync => "failed_sync",
    /// A running node's read found damage on its disk and the node stopped.
    CorruptFoundOnRead => "corrupt_found_on_read",
    /// Opening a node's storage found a corrupt sector: the node stayed down.
    CorruptFoundOnOpen => "corrupt_found_on_open",
    /// A damaged sector at the very end of the log passed for a torn write
    /// and was cut with synced data in it (the storage's documented limit);
    /// the simulator, which knows it damaged the disk, keeps the node down.
    CorruptTailTakenForTorn => "corrupt_tail_taken_for_torn",
    /// A node with a corrupt disk was replaced: removed, and a new id added
    /// as a learner and promoted.
    NodeRepaired => "node_repaired",
    @multi_group {
        /// One sync of a node's log made writes of two or more groups durable.
        SyncCoveredGroups => "sync_covered_groups",
        /// Installing a snapshot of one group synced other groups' writes.
        InstallSyncedOtherGroups => "install_synced_other_groups",
        /// A group with no client traffic elected a leader after an earlier
        /// leader of it (a crashed or cut-off one, say).
        IdleGroupReelected => "idle_group_reelected",
        /// Groups on one node had different leaders at one time.
        GroupLeadersSpread => "group_leaders_spread",
    }
}

/// Per-counter event counts of one seed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Coverage {
    counts: Vec<u64>,
}

impl Coverage {
    /// Counts one event.
    pub fn hit(&mut self, counter: Counter) {
        self.add(counter, 1);
    }

    /// Counts `n` events.
    pub fn add(&mut self, counter: Counter, n: u64) {
        let i = counter as usize;
        if self.counts.len() <= i {
            self.counts.resize(Counter::COUNT, 0);
        }
        self.counts[i] += n;
    }

    /// How often `counter` happened.
    pub fn count(&self, counter: Counter) -> u64 {
        self.counts.get(counter as usize).copied().unwrap_or(0)
    }
}

/// Coverage summed over seeds: for each counter, in how many seeds it happened.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CoverageSummary {
    seeds: Vec<u64>,
    events: Vec<u64>,
}

impl CoverageSummary {
    /// Adds one seed's coverage.
    pub fn add_seed(&mut self, coverage: &Coverage) {
        self.seeds.resize(Counter::COUNT, 0);
        self.events.resize(Counter::COUNT, 0);
        for &counter in Counter::ALL.iter().chain(Counter::MULTI_GROUP) {
            let n = coverage.count(counter);
            if n > 0 {
                self.seeds[counter as usize] += 1;
                self.events[counter as usize] += n;
            }
        }
    }

    /// In how many seeds `counter` happened.
    pub fn seeds_with(&self, counter: Counter) -> u64 {
        self.seeds.get(counter as usize).copied().unwrap_or(0)
    }

    /// How many times `counter` happened over all seeds.
    pub fn events(&self, counter: Counter) -> u64 {
        self.events.get(counter as usize).copied().unwrap_or(0)
    }

    /// The counters no seed exercised.
    pub fn gaps(&self) -> Vec<Counter> {
        Counter::ALL
            .iter()
            .copied()
            .filter(|c| self.seeds_with(*c) == 0)
            .collect()
    }

    /// The multi-group counters no seed exercised.
    pub fn multi_group_gaps(&self) -> Vec<Counter> {
        Counter::MULTI_GROUP
            .iter()
            .copied()
            .filter(|c| self.seeds_with(*c) == 0)
            .collect()
    }

    /// The multi-group counters, one `name=seeds/events` item each, space
    /// separated (the [`fmt::Display`] form lists the others).
    pub fn multi_group(&self) -> String {
        Counter::MULTI_GROUP
            .iter()
            .map(|&c| format!("{}={}/{}", c.label(), self.seeds_with(c), self.events(c)))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

impl fmt::Display for CoverageSummary {
    /// One `name=seeds/events` item per counter, space separated.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, &counter) in Counter::ALL.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(
                f,
                "{}={}/{}",
                counter.label(),
                self.seeds_with(counter),
                self.events(counter)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_counts_seeds_and_events() {
        let mut a = Coverage::default();
        a.hit(Counter::ClockJump);
        a.hit(Counter::ClockJump);
        let mut b = Coverage::default();
        b.hit(Counter::ClockJump);
        b.hit(Counter::ReadOk);
        let mut summary = CoverageSummary::default();
        summary.add_seed(&a);
        summary.add_seed(&b);
        assert_eq!(summary.seeds_with(Counter::ClockJump), 2);
        assert_eq!(summary.events(Counter::ClockJump), 3);
        assert_eq!(summary.seeds_with(Counter::ReadOk), 1);
        assert!(summary.gaps().contains(&Counter::CrashRestart));
        assert!(summary.to_string().contains("clock_jump=2/3"));
    }
}
