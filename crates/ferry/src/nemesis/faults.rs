//! The nemesis: faults drawn from the seed, one at a time, each applied for
//! a second or a few and then healed, with calm between them. Half the
//! time the target is the member that leads at that moment (asked of the
//! members), otherwise one drawn at random. Every fault applied and healed
//! is recorded; a member that exits by itself is recorded as a crash and
//! started again, so that the run goes on and the crash fails it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::history::{FaultRecord, Record, Recorder};
use super::members::{Crash, Members};
use super::testbed::{Testbed, TestbedError};
use super::workload::{self, Clients};

/// The kinds of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum FaultKind {
    /// A minority (one member of three, up to two of five) cut off from
    /// the rest, both ways.
    Partition,
    /// One member's packets to another dropped, the other way open.
    OneWay,
    /// 20 to 50% of the packets between two members dropped, both ways.
    Loss,
    /// A member stopped with SIGSTOP, then continued with SIGCONT.
    Pause,
    /// A member killed with SIGKILL, then started again on its data.
    Kill,
    /// Every free byte of a member's file system taken, then given back
    /// (and the NOSPACE alarm disarmed, as an operator would).
    DiskFull,
    /// A member's file system frozen: its writes and fsyncs wait for the
    /// whole fault (a disk that stalls).
    DiskStall,
}

impl FaultKind {
    /// Every kind, in order.
    pub const ALL: [FaultKind; 7] = [
        FaultKind::Partition,
        FaultKind::OneWay,
        FaultKind::Loss,
        FaultKind::Pause,
        FaultKind::Kill,
        FaultKind::DiskFull,
        FaultKind::DiskStall,
    ];

    /// The name in records and summaries.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Partition => "partition",
            FaultKind::OneWay => "one-way",
            FaultKind::Loss => "loss",
            FaultKind::Pause => "pause",
            FaultKind::Kill => "kill",
            FaultKind::DiskFull => "disk-full",
            FaultKind::DiskStall => "disk-stall",
        }
    }
}

/// The process number disarm requests are recorded under.
pub const NEMESIS_PROCESS: u64 = 900_000;

/// What the nemesis needs.
pub struct Nemesis {
    /// The members.
    pub members: Arc<Mutex<Members>>,
    /// The network and disks.
    pub testbed: Arc<Mutex<Testbed>>,
    /// For asking who leads, and disarming alarms.
    pub clients: Clients,
    /// The runtime the clients run on.
    pub runtime: tokio::runtime::Handle,
    /// Where faults are recorded.
    pub recorder: Recorder,
    /// The kinds to draw from.
    pub kinds: Vec<FaultKind>,
    /// The seed.
    pub seed: u64,
    /// How long to keep applying faults.
    pub duration: Duration,
}

/// What the nemesis did.
#[derive(Debug, Default)]
pub struct NemesisReport {
    /// Faults applied, by kind name.
    pub applied: BTreeMap<&'static str, u64>,
    /// Of those, how many struck the leader.
    pub at_leader: u64,
    /// Members that exited by themselves.
    pub crashes: Vec<Crash>,
    /// A fault that could not be applied or healed: the run is void.
    pub error: Option<String>,
}

/// One fault as applied, with what healing it needs.
enum Applied {
    Network,
    Paused(u64),
    Killed(u64),
    Filled(u64),
    Frozen(u64),
}

impl Nemesis {
    fn lock_members(&self) -> std::sync::MutexGuard<'_, Members> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_testbed(&self) -> std::sync::MutexGuard<'_, Testbed> {
        self.testbed.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, kind: FaultKind, heal: bool, targets: Vec<u64>, detail: String) {
        self.recorder.push(Record::Fault(FaultRecord {
            at_us: self.recorder.now_us(),
            fault: kind.name().to_string(),
            heal,
            targets,
            detail,
        }));
    }

    /// Sleeps `duration` in small steps, restarting members that crashed.
    fn sleep_watching(&self, duration: Duration, report: &mut NemesisReport) {
        let until = Instant::now() + duration;
        loop {
            self.restart_crashed(report);
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            std::thread::sleep(left.min(Duration::from_millis(100)));
        }
    }

    fn restart_crashed(&self, report: &mut NemesisReport) {
        let crashes = self.lock_members().crashed();
        for crash in crashes {
            let tail = self.lock_members().log_tail(crash.id, 20);
            eprintln!(
                "ferry nemesis: member {} exited by itself ({}); its log ends:\n{tail}",
                crash.id, crash.status
            );
            self.recorder.push(Record::Fault(FaultRecord {
                at_us: self.recorder.now_us(),
                fault: "crash".into(),
                heal: false,
                targets: vec![crash.id],
                detail: crash.status.clone(),
            }));
            if let Err(error) = self.lock_members().start(crash.id) {
                report.error.get_or_insert(error.to_string());
            }
            report.crashes.push(crash);
        }
    }

    /// Applies faults until the duration is over, then heals the last one;
    /// returns what it did.
    pub fn run(&self) -> NemesisReport {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x6e65_6d65_7369_7321);
        let mut report = NemesisReport::default();
        let started = Instant::now();
        let ids = self.lock_members().ids();
        while started.elapsed() < self.duration && report.error.is_none() {
            let calm = Duration::from_millis(300 + rng.next_u64() % 1200);
            self.sleep_watching(calm, &mut report);
            if started.elapsed() >= self.duration {
                break;
            }
            let kind = self.kinds[(rng.next_u64() % self.kinds.len() as u64) as usize];
            let at_leader = rng.next_u32() % 2 == 0;
            let leader = if at_leader {
                self.runtime.block_on(workload::leader(&self.clients))
            } else {
                None
            };
            let random = ids[(rng.next_u64() % ids.len() as u64) as usize];
            let target = leader.unwrap_or(random);
            let other = {
                let others: Vec<u64> = ids.iter().copied().filter(|id| *id != target).collect();
                others[(rng.next_u64() % others.len() as u64) as usize]
            };
            let hold = Duration::from_millis(1000 + rng.next_u64() % 3000);
            let detail = if leader.is_some() { "leader" } else { "random" };
            let applied = match self.apply(kind, target, other, &ids, &mut rng, detail) {
                Ok(applied) => applied,
                Err(error) => {
                    report.error = Some(error.to_string());
                    break;
                }
            };
            *report.applied.entry(kind.name()).or_default() += 1;
            report.at_leader += u64::from(leader.is_some());
            self.sleep_watching(hold, &mut report);
            if let Err(error) = self.heal(kind, applied) {
                report.error = Some(error.to_string());
                break;
            }
        }
        self.restart_crashed(&mut report);
        report
    }

    fn apply(
        &self,
        kind: FaultKind,
        target: u64,
        other: u64,
        ids: &[u64],
        rng: &mut ChaCha8Rng,
        why: &str,
    ) -> Result<Applied, TestbedError> {
        let applied = match kind {
            FaultKind::Partition => {
                // A minority: the target, and for five members perhaps one more.
                let mut side = vec![target];
                let minority_max = (ids.len() - 1) / 2;
                if minority_max >= 2 && rng.next_u32() % 2 == 0 {
                    side.push(other);
                }
                self.lock_testbed().partition(&side)?;
                self.record(
                    kind,
                    false,
                    side.clone(),
                    format!("{why}; cut off from the rest"),
                );
                Applied::Network
            }
            FaultKind::OneWay => {
                // Half the time the target cannot send, half the time it
                // cannot hear.
                let (from, to) = if rng.next_u32() % 2 == 0 {
                    (target, other)
                } else {
                    (other, target)
                };
                self.lock_testbed().drop_packets(from, to, 1.0)?;
                self.record(
                    kind,
                    false,
                    vec![target],
                    format!("{why}; {from} -> {to} dropped"),
                );
                Applied::Network
            }
            FaultKind::Loss => {
                let probability = 0.2 + (rng.next_u64() % 31) as f64 / 100.0;
                let testbed = self.lock_testbed();
                testbed.drop_packets(target, other, probability)?;
                testbed.drop_packets(other, target, probability)?;
                drop(testbed);
                self.record(
                    kind,
                    false,
                    vec![target, other],
                    format!(
                        "{why}; {:.0}% of packets dropped both ways",
                        probability * 100.0
                    ),
                );
                Applied::Network
            }
            FaultKind::Pause => {
                self.lock_members().pause(target)?;
                self.record(kind, false, vec![target], why.to_string());
                Applied::Paused(target)
            }
            FaultKind::Kill => {
                self.lock_members().kill(target);
                self.record(kind, false, vec![target], why.to_string());
                Applied::Killed(target)
            }
            FaultKind::DiskFull => {
                let taken = self.lock_testbed().fill_disk(target)?;
                self.record(
                    kind,
                    false,
                    vec![target],
                    format!("{why}; {taken} bytes taken"),
                );
                Applied::Filled(target)
            }
            FaultKind::DiskStall => {
                self.lock_testbed().freeze_disk(target)?;
                self.record(
                    kind,
                    false,
                    vec![target],
                    format!("{why}; file system frozen"),
                );
                Applied::Frozen(target)
            }
        };
        Ok(applied)
    }

    fn heal(&self, kind: FaultKind, applied: Applied) -> Result<(), TestbedError> {
        let targets = match applied {
            Applied::Network => {
                self.lock_testbed().heal_network()?;
                Vec::new()
            }
            Applied::Paused(id) => {
                self.lock_members().resume(id)?;
                vec![id]
            }
            Applied::Killed(id) => {
                self.lock_members().start(id)?;
                vec![id]
            }
            Applied::Filled(id) => {
                self.lock_testbed().free_disk(id)?;
                vec![id]
            }
            Applied::Frozen(id) => {
                self.lock_testbed().thaw_disk(id)?;
                vec![id]
            }
        };
        self.record(kind, true, targets, String::new());
        if kind == FaultKind::DiskFull {
            // The member's log retries every half second and its reserve
            // check runs every second: give both time to see the room
            // before disarming, or the alarm is raised again at once.
            std::thread::sleep(Duration::from_millis(1500));
            self.disarm_alarms(Duration::from_secs(10));
        }
        Ok(())
    }

    /// Disarms NOSPACE alarms through any member that answers, until none
    /// is left or `within` has passed; returns whether none is left.
    pub fn disarm_alarms(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let ids = self.lock_members().ids();
        let mut turn = 0usize;
        loop {
            let member = ids[turn % ids.len()];
            turn += 1;
            let raised = self.runtime.block_on(workload::disarm_no_space(
                &self.clients,
                NEMESIS_PROCESS,
                member,
            ));
            if raised == Some(0) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}
