//! The parameters of one simulated run, all drawn from its seed unless a
//! scenario sets them.

use ferry_raft::{GroupId, NodeId, Options};

use crate::net::NetConfig;
use crate::rng::SimRng;

/// The simulated length of one tick at the nominal clock rate.
pub const TICK_US: u64 = 1_000;

/// The most Raft groups a simulated node hosts.
pub const GROUPS_MAX: usize = 64;

/// The most a node's tick period deviates from nominal, in percent, in a
/// run with lease reads. A lease keeps back a quarter of the election
/// timeout for clock drift (see ferry_raft's crate docs): with periods
/// within 10% of nominal, a follower's clock runs at most 22% faster than
/// the leader's.
pub const LEASE_DRIFT_PERCENT_MAX: u64 = 10;

/// Which faults the run injects, and how often.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultConfig {
    /// Whether faults are injected at all.
    pub enabled: bool,
    /// The mean time between two fault events.
    pub mean_interval_us: u64,
    /// Relative weights of the fault kinds.
    pub crash_weight: u64,
    /// Pauses (SIGSTOP-like).
    pub pause_weight: u64,
    /// Partitions (and their healing).
    pub partition_weight: u64,
    /// Clogged links.
    pub clog_weight: u64,
    /// Clock jumps.
    pub clock_jump_weight: u64,
    /// Changes of a node's clock rate.
    pub drift_weight: u64,
    /// The most nodes down (crashed) at once.
    pub crashed_max: usize,
    /// Whether membership changes are issued.
    pub membership: bool,
    /// The mean time between two membership requests.
    pub membership_interval_us: u64,
    /// The most a node's tick period deviates from nominal, in percent.
    pub drift_percent_max: u64,
}

impl FaultConfig {
    /// No faults at all (scenarios inject their own).
    pub fn none() -> Self {
        FaultConfig {
            enabled: false,
            mean_interval_us: u64::MAX,
            crash_weight: 0,
            pause_weight: 0,
            partition_weight: 0,
            clog_weight: 0,
            clock_jump_weight: 0,
            drift_weight: 0,
            crashed_max: 0,
            membership: false,
            membership_interval_us: u64::MAX,
            drift_percent_max: 0,
        }
    }

    /// Every fault on, with rates drawn from the run's generator.
    pub fn random(rng: &mut SimRng, voters: usize) -> Self {
        FaultConfig {
            enabled: true,
            mean_interval_us: rng.range(5, 40) * TICK_US,
            crash_weight: rng.range(1, 10),
            pause_weight: rng.range(1, 10),
            partition_weight: rng.range(1, 10),
            clog_weight: rng.range(1, 10),
            clock_jump_weight: rng.range(1, 5),
            drift_weight: rng.range(1, 5),
            crashed_max: rng.range_inclusive(1, voters as u64) as usize,
            membership: true,
            membership_interval_us: rng.range(20, 150) * TICK_US,
            drift_percent_max: rng.range(0, 30),
        }
    }
}

/// The engine settings of a run (shared by its nodes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Least election timeout.
    pub election_timeout_ticks: u32,
    /// Heartbeat interval.
    pub heartbeat_interval_ticks: u32,
    /// Pre-vote on.
    pub pre_vote: bool,
    /// Check-quorum on.
    pub check_quorum: bool,
    /// Followers forward requests to the leader.
    pub forward_requests: bool,
    /// Inflight window in messages.
    pub inflight_messages_max: usize,
    /// Inflight window in bytes.
    pub inflight_bytes_max: u64,
    /// Most entry bytes per append.
    pub append_bytes_max: u64,
    /// Snapshot chunk size.
    pub snapshot_chunk_bytes: u64,
    /// Chunk acknowledgement timeout.
    pub snapshot_chunk_timeout_ticks: u32,
    /// Request timeout.
    pub request_timeout_ticks: u32,
    /// Most pending requests per node.
    pub pending_requests_max: usize,
    /// Entries kept behind a snapshot.
    pub compaction_lag_entries: u64,
    /// Leaders serve lease reads (clients ask for them on some reads).
    pub lease_reads: bool,
    /// Idle groups go quiet (`ferry_raft::Options::quiesce`). Never drawn
    /// by [`EngineConfig::random`]: see [`QuiesceMode`].
    pub quiesce: bool,
    /// The most settled entry bytes the engine holds in memory
    /// (`ferry_raft::Options::log_memory_bytes_max`).
    pub log_memory_bytes_max: u64,
    /// The most settled entries the engine holds in memory
    /// (`ferry_raft::Options::log_memory_entries_max`).
    pub log_memory_entries_max: u64,
}

impl EngineConfig {
    /// The engine's defaults, with the small thresholds the simulator wants.
    pub fn small() -> Self {
        EngineConfig {
            election_timeout_ticks: 10,
            heartbeat_interval_ticks: 1,
            pre_vote: true,
            check_quorum: true,
            forward_requests: true,
            inflight_messages_max: 16,
            inflight_bytes_max: 64 << 10,
            append_bytes_max: 4 << 10,
            snapshot_chunk_bytes: 128,
            snapshot_chunk_timeout_ticks: 10,
            request_timeout_ticks: 40,
            pending_requests_max: 1024,
            compaction_lag_entries: 2,
            lease_reads: false,
            quiesce: false,
            log_memory_bytes_max: Options::new(1, 1).log_memory_bytes_max,
            log_memory_entries_max: Options::new(1, 1).log_memory_entries_max,
        }
    }

    /// Settings drawn from the run's generator.
    pub fn random(rng: &mut SimRng) -> Self {
        EngineConfig {
            election_timeout_ticks: rng.range(8, 20) as u32,
            heartbeat_interval_ticks: rng.range(1, 4) as u32,
            pre_vote: rng.chance_percent(80),
            check_quorum: rng.chance_percent(80),
            forward_requests: rng.chance_percent(80),
            inflight_messages_max: rng.range(1, 32) as usize,
            inflight_bytes_max: rng.range(200, 64 << 10),
            append_bytes_max: rng.range(50, 8 << 10),
            snapshot_chunk_bytes: rng.range(16, 512),
            snapshot_chunk_timeout_ticks: rng.range(5, 30) as u32,
            request_timeout_ticks: rng.range(20, 60) as u32,
            pending_requests_max: if rng.chance_percent(20) {
                rng.range(2, 16) as usize
            } else {
                1024
            },
            compaction_lag_entries: rng.range(0, 20),
            // Drawn last in `SimConfig::random`, with the faults it allows.
            lease_reads: false,
            // Set by `SimConfig::apply_quiesce`, from a stream of its own.
            quiesce: false,
            // Drawn by `SimConfig::random`, from a stream of its own.
            log_memory_bytes_max: Options::new(1, 1).log_memory_bytes_max,
            log_memory_entries_max: Options::new(1, 1).log_memory_entries_max,
        }
    }

    /// The engine options of node `id`.
    pub fn options(&self, id: NodeId, group: u64) -> Options {
        let mut options = Options::new(id, group);
        options.election_timeout_ticks = self.election_timeout_ticks;
        options.heartbeat_interval_ticks = self.heartbeat_interval_ticks;
        options.pre_vote = self.pre_vote;
        options.check_quorum = self.check_quorum;
        options.lease_reads = self.lease_reads;
        options.forward_requests = self.forward_requests;
        options.inflight_messages_max = self.inflight_messages_max;
        options.inflight_bytes_max = self.inflight_bytes_max;
        options.append_bytes_max = self.append_bytes_max;
        options.snapshot_chunk_bytes = self.snapshot_chunk_bytes;
        options.snapshot_chunk_timeout_ticks = self.snapshot_chunk_timeout_ticks;
        options.request_timeout_ticks = self.request_timeout_ticks;
        options.pending_requests_max = self.pending_requests_max;
        options.compaction_lag_entries = self.compaction_lag_entries;
        options.quiesce = self.quiesce;
        options.log_memory_bytes_max = self.log_memory_bytes_max;
        options.log_memory_entries_max = self.log_memory_entries_max;
        options
    }
}

/// Which seeds run with quiescence on (`ferry sim --quiesce`). A seed's
/// other parameters are the same in every mode: `Drawn` takes its flag from
/// a generator of its own, seeded from the seed, so the run's own
/// generator draws exactly what it always did, and `Off` runs every seed
/// exactly as before quiescence existed (the regression seeds too).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuiesceMode {
    /// Quiescence off on every seed (the default).
    #[default]
    Off,
    /// Quiescence on for every seed.
    On,
    /// Quiescence on for about half the seeds, drawn per seed.
    Drawn,
}

/// Mixed into the seed for the generator that draws [`QuiesceMode::Drawn`].
const QUIESCE_STREAM: u64 = 0x0071_e5ce_5eed_0001;

/// The stream the log memory bound is drawn from, apart from the run's own
/// generator: a seed draws everything else as it did before the bound.
const LOG_MEMORY_STREAM: u64 = 0x10a9_3e30_5eed_0002;

/// A deliberate runtime bug, to show that the checks catch its class
/// (used by the simulator's own tests; never on in real runs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sabotage {
    /// The runtime does what it promises.
    #[default]
    None,
    /// Report writes durable as soon as they are written, before any sync:
    /// the durability checks must object.
    PersistedBeforeSync,
    /// Answer reads from the contact node's state machine at once, without
    /// ReadIndex: the linearizability check must object.
    LocalReads,
    /// When a node's storage is found corrupt, wipe its disk and restart it
    /// empty under its old identity (what the storage crate forbids: it has
    /// forgotten its votes and its log): the restart check must object.
    RestartOnCorruptDisk,
}

/// The node storage of a run: the in-memory model alone, or the real
/// storage code on a simulated disk beside it, with disk faults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    /// Whether nodes run on `ferry_storage::Storage` over a `SimDisk`.
    pub real: bool,
    /// The fewest disk ticks (of [`crate::real_storage::DISK_TICK_US`]) a sync takes.
    pub sync_ticks_min: u64,
    /// The most disk ticks a sync takes (large values are slow syncs).
    pub sync_ticks_max: u64,
    /// Weight of disk faults among the other faults (0: none).
    pub fault_weight: u64,
    /// Node ids kept aside to replace nodes whose disk was corrupted.
    pub replacements: usize,
}

impl DiskConfig {
    /// The in-memory model only, no disk faults.
    pub fn model() -> Self {
        DiskConfig {
            real: false,
            sync_ticks_min: 0,
            sync_ticks_max: 0,
            fault_weight: 0,
            replacements: 0,
        }
    }

    /// Half the seeds run on the real storage with disk faults.
    pub fn random(rng: &mut SimRng) -> Self {
        if !rng.chance_percent(50) {
            return DiskConfig::model();
        }
        let sync_ticks_min = rng.range(0, 3);
        let sync_ticks_max = sync_ticks_min
            + if rng.chance_percent(30) {
                rng.range(10, 60)
            } else {
                rng.range(1, 8)
            };
        DiskConfig {
            real: true,
            sync_ticks_min,
            sync_ticks_max,
            fault_weight: rng.range(1, 6),
            replacements: 1,
        }
    }
}

/// Everything that shapes one run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// The seed every choice is drawn from.
    pub seed: u64,
    /// The founding voters (3, 5 or 7).
    pub voters: usize,
    /// Node ids beyond the voters that membership changes may add.
    pub spares: usize,
    /// How long faults and the workload run.
    pub main_phase_us: u64,
    /// How many election timeouts the cluster gets to converge once faults stop.
    pub liveness_election_timeouts: u64,
    /// The engine settings.
    pub engine: EngineConfig,
    /// The network.
    pub net: NetConfig,
    /// The faults.
    pub faults: FaultConfig,
    /// A node's state machine takes a snapshot after this many applied entries.
    pub snapshot_every_entries: u64,
    /// Concurrent clients of the register workload (0: none).
    pub clients: usize,
    /// The registers the workload uses.
    pub keys: u64,
    /// The most a client waits between operations.
    pub think_time_max_us: u64,
    /// The least and most delay of a disk sync.
    pub sync_delay_us: (u64, u64),
    /// The shortest a connection takes to set up.
    pub connect_window_min_us: u64,
    /// The longest a connection takes to set up (messages sent meanwhile are lost).
    pub connect_window_max_us: u64,
    /// Whether the runtime tells the engine when a peer connects. Off only
    /// to show what happens without it (the class of seed 002).
    pub peer_connected_events: bool,
    /// Whether to record a trace.
    pub trace: bool,
    /// A deliberate runtime bug (tests of the checks only).
    pub sabotage: Sabotage,
    /// The node storage and its faults.
    pub disk: DiskConfig,
    /// The Raft groups each node hosts (ids 1..=groups), all founded by the
    /// same voters, sharing each node's log and each pair's link.
    pub groups: usize,
    /// How many of the groups (the highest ids) get no client traffic at
    /// all: the liveness phase must still find each with a leader and its
    /// live members caught up.
    pub idle_groups: usize,
}

impl SimConfig {
    /// A run whose parameters all come from `seed`; `voters` overrides the
    /// drawn cluster size.
    pub fn random(seed: u64, voters: Option<usize>) -> Self {
        let mut rng = SimRng::new(seed ^ 0x5eed_c0f1_9000_0000);
        let drawn = *rng.pick(&[3usize, 3, 5, 5, 7]).unwrap_or(&3);
        let voters = voters.unwrap_or(drawn);
        let mut config = SimConfig {
            seed,
            voters,
            spares: 2,
            main_phase_us: rng.range(300, 1_500) * TICK_US,
            liveness_election_timeouts: 30,
            engine: EngineConfig::random(&mut rng),
            net: NetConfig::random(&mut rng),
            faults: FaultConfig::random(&mut rng, voters),
            snapshot_every_entries: rng.range(3, 40),
            clients: rng.range_inclusive(1, 8) as usize,
            keys: rng.range_inclusive(1, 4),
            think_time_max_us: rng.range(0, 4) * TICK_US,
            sync_delay_us: (20, 20 + rng.range(10, 800)),
            connect_window_min_us: 0,
            connect_window_max_us: rng.range(0, 3) * TICK_US,
            peer_connected_events: true,
            trace: false,
            sabotage: Sabotage::None,
            disk: DiskConfig::random(&mut rng),
            groups: 1,
            idle_groups: 0,
        };
        // Drawn after everything else, so that the other draws of a seed
        // are the same with or without lease reads in the simulator.
        if rng.chance_percent(25) {
            config.allow_lease_reads();
        }
        // On about half the seeds the engine holds only a few settled
        // entries in memory (a handful, or a few hundred bytes), so that
        // leaders load entries from storage for lagging followers all the
        // time; the others keep the engine's defaults.
        let mut memory = SimRng::new(seed ^ LOG_MEMORY_STREAM);
        if memory.chance_percent(50) {
            if memory.chance_percent(50) {
                config.engine.log_memory_entries_max = memory.range(0, 8);
            } else {
                config.engine.log_memory_bytes_max = memory.range(0, 4 << 10);
            }
        }
        config
    }

    /// Sets quiescence for this run by `mode` (drawing nothing from the
    /// run's own generator).
    pub fn apply_quiesce(&mut self, mode: QuiesceMode) {
        self.engine.quiesce = match mode {
            QuiesceMode::Off => false,
            QuiesceMode::On => true,
            QuiesceMode::Drawn => SimRng::new(self.seed ^ QUIESCE_STREAM).chance_percent(50),
        };
    }

    /// Turns lease reads on, with the faults restricted to those under which
    /// a lease is safe: check-quorum on, no clock jumps, no pauses (a paused
    /// leader's ticks stop while real time goes on), and bounded drift.
    /// Crashes, partitions, lost and late messages stay.
    pub fn allow_lease_reads(&mut self) {
        self.engine.lease_reads = true;
        self.engine.check_quorum = true;
        self.faults.clock_jump_weight = 0;
        self.faults.pause_weight = 0;
        self.faults.drift_percent_max = self.faults.drift_percent_max.min(LEASE_DRIFT_PERCENT_MAX);
    }

    /// A quiet run for scenarios: reliable network, no faults, no clients.
    pub fn quiet(seed: u64, voters: usize) -> Self {
        SimConfig {
            seed,
            voters,
            spares: 2,
            main_phase_us: 1_000 * TICK_US,
            liveness_election_timeouts: 30,
            engine: EngineConfig::small(),
            net: NetConfig::reliable(),
            faults: FaultConfig::none(),
            snapshot_every_entries: 10,
            clients: 0,
            keys: 2,
            think_time_max_us: TICK_US,
            sync_delay_us: (50, 200),
            connect_window_min_us: 0,
            connect_window_max_us: 0,
            peer_connected_events: true,
            trace: false,
            sabotage: Sabotage::None,
            disk: DiskConfig::model(),
            groups: 1,
            idle_groups: 0,
        }
    }

    /// Hosts `groups` Raft groups on every node (clamped to
    /// 1..=[`GROUPS_MAX`]), about a quarter of them idle (at least one once
    /// there are two). Nothing is drawn: a seed's other parameters are the
    /// same with any number of groups.
    pub fn with_groups(mut self, groups: usize) -> Self {
        self.groups = groups.clamp(1, GROUPS_MAX);
        self.idle_groups = if self.groups >= 2 {
            self.groups.div_ceil(4)
        } else {
            0
        };
        self
    }

    /// Every group's id, in order.
    pub fn group_ids(&self) -> Vec<GroupId> {
        (1..=self.groups.max(1) as u64).collect()
    }

    /// The groups clients use (the idle ones are the highest ids).
    pub fn active_group_ids(&self) -> Vec<GroupId> {
        let active = self.groups.max(1).saturating_sub(self.idle_groups).max(1);
        (1..=active as u64).collect()
    }

    /// Whether `group` gets no client traffic.
    pub fn is_idle_group(&self, group: GroupId) -> bool {
        !self.active_group_ids().contains(&group)
    }

    /// The founding voters' ids.
    pub fn voter_ids(&self) -> Vec<NodeId> {
        (1..=self.voters as u64).collect()
    }

    /// Every node id of the run: voters, spares and replacements.
    pub fn all_ids(&self) -> Vec<NodeId> {
        (1..=(self.voters + self.spares + self.disk.replacements) as u64).collect()
    }

    /// The ids kept aside to replace nodes whose disk was corrupted.
    pub fn replacement_ids(&self) -> Vec<NodeId> {
        let first = (self.voters + self.spares) as u64 + 1;
        (first..first + self.disk.replacements as u64).collect()
    }
}
