//! # ferry-sim: the seeded simulator
//!
//! Runs nodes of the real engine in one thread over a simulated network,
//! disk and clock, drawing every choice from one seed, and checks safety
//! after every step, linearizability of the client history at the end, and
//! liveness once the faults stop.
//!
//! ## A run
//! [`sim::run_seed`] draws the run's parameters from the seed
//! ([`config::SimConfig::random`]: 3, 5 or 7 voters, engine timeouts and
//! window sizes, network rates, fault rates, snapshot threshold, workload)
//! and runs [`sim::Simulation`]: an event queue ordered by (simulated
//! microsecond, sequence number), one ChaCha8 generator ([`rng::SimRng`]).
//! Each node has a drifting tick clock, a [`storage::DiskModel`] per group it
//! hosts, in one [`storage::NodeDisk`] (writes are durable only once a later
//! sync completes; a crash loses the rest; a restart rebuilds the engines
//! from the synced state), a [`state_machine::RegisterMachine`] per group
//! that snapshots every few entries, and an inbox that fills while the node
//! is paused.
//!
//! ## Several groups per node
//! [`sim::run_seed_in_groups`] (`ferry sim --groups N`,
//! [`config::SimConfig::with_groups`]) runs N Raft groups, ids 1..=N, on
//! every node, all founded by the same voters, as a real deployment hosts
//! many in one process. What a node has, its groups share: one clock (a
//! tick, a clock jump or a pause strikes them all), one storage
//! ([`storage::NodeDisk`]: one durable log with group commit, so one sync
//! covers every group's writes since the last, a crash loses every group's
//! unsynced writes together, a failed sync stops the node and so fails for
//! every group it covered, and installing one group's snapshot syncs the
//! whole log; snapshots are per group), one inbox while paused, and one link
//! to each other node, carrying every group's messages (partitions, loss,
//! duplication, delay, reordering and clogging act on the link, so a
//! partition cuts every group at once, and [`ferry_raft::Input::PeerConnected`]
//! and `PeerDisconnected` go to every group on the node). Membership is per
//! group: a change goes to one group, so the groups' configurations drift
//! apart; a spare, once started, hosts every group. Each client operation
//! picks a group, whose registers are its own; about a quarter of the
//! groups (the highest ids) get no client or admin traffic at all. The
//! checks run per group: one safety checker and one history each, each
//! history checked for linearizability, and the liveness phase requires
//! every group, idle ones included, to converge (an idle group whose leader
//! crashed must have elected another). Per-group trace lines name the group
//! (`n2 g3 role Leader ...`). The choices only several groups need are drawn
//! from a second generator, so a run with one group draws, traces and ends
//! exactly as it did before groups existed.
//!
//! ## Storage: the model, and the real code on a simulated disk
//! Half the seeds ([`config::DiskConfig::random`]) also run every node on
//! the real storage code, `ferry_storage::Storage` over a `SimDisk` seeded
//! from the run's seed ([`real_storage::RealStorage`]), in lockstep with the
//! model: persist requests are appended to the real log, a sync is prepared,
//! executed on the simulated disk and completed after the disk's latency in
//! simulated time (the durable seq it reports for each group must equal the
//! model's, and it must cover exactly the groups the model's sync covered),
//! snapshots go through the snapshot store and are read back from it, and a
//! restart opens the storage on the disk as the crash left it (unsynced data
//! lost, kept, or torn: the three `CrashMode`s). After each restart
//! [`real_storage::check_restored`] proves, group by group, that what came
//! back is exactly the synced state plus a prefix of the writes in flight. Disk faults join
//! the fault mix: a power loss in the middle of a write (a torn write), a
//! failed sync (the storage poisons itself and the node stops, as the server
//! does, to be restarted later), slow syncs, and a damaged sector (on a
//! stopped node's disk, found when it opens; or in a running leader's
//! snapshot, found when it reads it to send). A node whose storage is found
//! corrupt never runs on it again: it stays down and
//! is replaced the documented way (removed from the group, its disk wiped,
//! a reserved new id added as a learner and promoted). At most one disk per
//! run is damaged, and only while every other voter can elect without it,
//! so a majority stays healthy; liveness is judged over the healthy nodes.
//!
//! Faults in the main phase: crash and restart, pause and resume, partitions
//! (random halves, one node isolated, one-way links) that heal, links that
//! clog and release what they held, clock jumps and rate changes, message
//! loss, duplication, delay and reordering, and a connection-setup window in
//! which a (re)connecting link loses what is sent before the engine is told
//! [`ferry_raft::Input::PeerConnected`]. Membership changes (add learner, add
//! voter, promote, remove, leadership transfer, and requests that make no
//! sense) go to random nodes. Clients run reads, writes and compare-and-set
//! on a few registers, retry definite refusals, and record
//! [`history::History`].
//!
//! ## What is checked
//! - After every step ([`checks::SafetyChecker`] and the runtime): one leader
//!   per term; log matching (one payload and one predecessor per (index,
//!   term)); leader completeness (a new leader holds every entry committed
//!   in an earlier term); no two nodes apply different entries at one index;
//!   entries are applied in order and only once committed; commit and
//!   applied never go back within a run of a node, and durable term, vote
//!   and commit never go back across restarts; appends are acknowledged to
//!   their leader, votes granted and asked for, only once synced; a read is
//!   ready only once applied; no client operation is applied twice.
//! - At the end: the history is linearizable ([`lincheck`]).
//! - Liveness: all faults off, everyone restarted, resumed and reconnected;
//!   within a bound in election timeouts there is one leader, every member
//!   follows it and has applied its commit index, the leader has committed
//!   its whole log, and every client operation has completed.
//! - A panic anywhere is caught and fails the seed.
//!
//! ## Quiescence
//! [`config::QuiesceMode`] decides which seeds run with idle groups going
//! quiet (`ferry_raft::Options::quiesce`): `Off` (the default: every seed
//! exactly as before), `On`, or `Drawn` (about half, from a generator of its
//! own seeded from the seed, so that the seed's other parameters are those
//! it always drew); `ferry sim --quiesce off|on|drawn`. With several groups
//! per node the flag holds for every group's engine alike, and the
//! quiescence draw, the seed's parameters and the choices only several
//! groups need come from three separate generators, so that `--groups` and
//! `--quiesce` combine without either changing what the other draws. The
//! runtime reports `PeerDisconnected` for crashes and for partitions that
//! cut a pair of nodes both ways (the host's part of the contract); one-way
//! cuts, clogged links and pauses report nothing, which the engine must
//! survive too (see ferry_raft's crate docs, "The host's part"). As a real
//! transport does, the runtime never delivers a message after reporting
//! the connection it was sent on broken: what was in flight between a pair
//! when a crash or a cut was reported is lost (with quiescence on only, so
//! that runs without it stay what they were). Quiesce
//! notices and wake-ups are counted in the [`SeedReport`], summed over the
//! groups, not as coverage counters, so that a run with quiescence off
//! reports what it always did.
//!
//! [`scenarios`] stages the three field reports, a restored stale data
//! directory, an idle group's leader crashing among busy groups and two
//! quiescence cases; [`coverage`] counts what each seed exercised (the
//! multi-group counters apart, [`Counter::MULTI_GROUP`]). `ferry sim` is
//! the command-line front end.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod checks;
pub mod config;
pub mod coverage;
pub mod history;
pub mod lincheck;
pub mod net;
pub mod real_storage;
pub mod rng;
pub mod scenarios;
pub mod sim;
pub mod state_machine;
pub mod storage;

pub use checks::{Failure, FailureKind};
pub use config::QuiesceMode;
pub use config::SimConfig;
pub use coverage::{Counter, Coverage, CoverageSummary};
pub use sim::{
    run_config, run_seed, run_seed_in_groups, run_seed_in_groups_with, run_seed_with, SeedReport,
    Simulation,
};
