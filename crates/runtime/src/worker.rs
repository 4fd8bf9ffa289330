//! Workers: the tasks that run the groups.
//!
//! Each group belongs to one worker, chosen by its id, for its whole life,
//! so that its inputs are handled in order; the workers run on tokio's
//! threads, so a node with N cores runs N groups' steps at once and one busy
//! group delays only the groups of its own worker. A worker owns its
//! groups outright (engine, machine, waiters): nothing in it is locked.
//!
//! A worker takes three kinds of input, in this order of priority:
//! completions of storage requests (unbounded: they answer what the worker
//! asked, one per request or per sync), its clock's ticks, and inputs from
//! outside (peer messages, client calls, group starts and stops; bounded,
//! so that a flood of them waits in the transport or in the caller).

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use ferry_raft::{GroupId, Index, Message, NodeId};

use crate::error::GroupError;
use crate::log_task::LogRequest;
use crate::transport::BufferLease;

/// The most inputs queued for one worker before senders wait.
pub(crate) const WORKER_INPUTS_QUEUED_MAX: usize = 4096;

/// The most inputs a worker takes in one turn beyond the one it woke for,
/// before it steps its groups: a bound on a batch, and on how long the
/// queue waits while a turn runs.
pub(crate) const INPUTS_PER_TURN_MAX: usize = 256;

/// An input to a worker from outside.
pub(crate) enum WorkerInput {
    /// A message from a peer for one of the worker's groups. The lease
    /// holds the frame's share of the transport's inbound budget until the
    /// message is stepped (at the end of the worker's turn).
    Message(Message, BufferLease),
    /// The link to a peer node came up: every group hears of it.
    PeerConnected(NodeId),
    /// The link to a peer node went down.
    PeerDisconnected(NodeId),
    /// A call from a group handle (a `Call<M>` of the group's machine).
    Call {
        group: GroupId,
        call: Box<dyn Any + Send>,
    },
    /// Start running a group.
    Start {
        group: GroupId,
        runner: Box<dyn GroupRun>,
        reply: oneshot::Sender<Result<(), GroupError>>,
    },
    /// Stop running a group (its data stays).
    Stop {
        group: GroupId,
        reply: oneshot::Sender<Result<(), GroupError>>,
    },
}

/// The data of a snapshot received from the leader, sealed on disk and
/// read back block by block to restore the machine from: a received state
/// is never held in memory whole.
pub(crate) type ReceivedSnapshot = Box<ferry_storage::SnapshotDataReader<ferry_storage::FsDisk>>;

/// The answer to something a group asked of the storage.
pub(crate) enum Completion {
    /// The group's writes through `seq` are durable.
    Persisted { seq: u64 },
    /// A snapshot chunk for a follower was read.
    ChunkLoaded {
        to: NodeId,
        snapshot_index: Index,
        offset: u64,
        /// The data and whether it is the last chunk; `None` if the
        /// snapshot is gone (a newer one replaced it).
        chunk: Option<(bytes::Bytes, bool)>,
    },
    /// Log entries for a follower were read (`None`: the log no longer
    /// holds them).
    EntriesLoaded {
        to: NodeId,
        term: ferry_raft::Term,
        from: Index,
        entries: Option<Vec<ferry_raft::Entry>>,
    },
    /// A chunk of a snapshot from the leader was written (`last`: it was
    /// the last, and the file is sealed: `received` reads it back).
    ChunkSaved {
        index: Index,
        offset: u64,
        ok: bool,
        last: bool,
        received: Option<ReceivedSnapshot>,
    },
    /// A group's machine is back from restoring a received snapshot on a
    /// blocking thread (a `M` boxed), with the snapshot's size or why it
    /// did not restore.
    Restored {
        machine: Box<dyn Any + Send>,
        outcome: Result<u64, String>,
        index: Index,
        offset: u64,
    },
    /// The received snapshot is installed, durably.
    Installed { index: Index, offset: u64 },
    /// A local snapshot was written and saved.
    SnapshotTaken { index: Index, bytes: u64 },
    /// A local snapshot could not be written for now (no descriptors or
    /// space); nothing was lost.
    SnapshotFailed { index: Index, error: String },
}

/// What a worker's group does with its inputs: [`crate::group::Group`] for
/// any machine, behind one object-safe face.
pub(crate) trait GroupRun: Send {
    /// A message from a peer.
    fn message(&mut self, message: Message, out: &mut Outbox);
    /// A peer node's link came up or went down.
    fn peer(&mut self, peer: NodeId, up: bool, out: &mut Outbox);
    /// A call from the group's handle.
    fn call(&mut self, call: Box<dyn Any + Send>, out: &mut Outbox);
    /// One tick of the clock.
    fn tick(&mut self, out: &mut Outbox);
    /// A storage completion.
    fn complete(&mut self, completion: Completion, out: &mut Outbox);
    /// Steps the inputs taken since the last flush (messages, calls and
    /// persistence completions are batched; see `Group::enqueue`).
    fn flush(&mut self, out: &mut Outbox);
    /// The group is being stopped: every caller waiting is told.
    fn stop(&mut self);
}

/// What a group's step wants sent to the storage, in order. The worker
/// sends it after the step (waiting if the log's queue is full).
#[derive(Default)]
pub(crate) struct Outbox {
    pub(crate) log: Vec<LogRequest>,
}

/// The senders of every worker: where the host, the transport's router and
/// the log task send to.
#[derive(Clone)]
pub(crate) struct Workers {
    inputs: Arc<[mpsc::Sender<WorkerInput>]>,
    completions: Arc<[mpsc::UnboundedSender<(GroupId, Completion)>]>,
}

impl Workers {
    /// The index of the worker that owns `group`.
    fn of(&self, group: GroupId) -> usize {
        // Consecutive ids spread evenly; the multiplier mixes the rest.
        (group.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize % self.inputs.len()
    }

    /// Sends an input to the worker of `group`, waiting while its queue is
    /// full. False if the worker is gone (the host is stopping).
    pub(crate) async fn input(&self, group: GroupId, input: WorkerInput) -> bool {
        self.inputs[self.of(group)].send(input).await.is_ok()
    }

    /// Sends an input to every worker (a peer's link state).
    pub(crate) async fn broadcast(&self, input: impl Fn() -> WorkerInput) {
        for sender in self.inputs.iter() {
            let _ = sender.send(input()).await;
        }
    }

    /// Inputs queued for all workers now.
    pub(crate) fn queued_inputs(&self) -> usize {
        self.inputs
            .iter()
            .map(|sender| sender.max_capacity().saturating_sub(sender.capacity()))
            .sum()
    }

    /// Hands a storage completion to the worker of `group`. Never waits.
    pub(crate) fn complete(&self, group: GroupId, completion: Completion) {
        let _ = self.completions[self.of(group)].send((group, completion));
    }
}

/// Starts `count` workers ticking every `tick`, sending their storage
/// requests to `log`.
pub(crate) fn spawn(
    count: usize,
    tick: Duration,
    log: mpsc::Sender<LogRequest>,
) -> (Workers, Vec<tokio::task::JoinHandle<()>>) {
    let count = count.max(1);
    let mut inputs = Vec::with_capacity(count);
    let mut completions = Vec::with_capacity(count);
    let mut tasks = Vec::with_capacity(count);
    for _ in 0..count {
        let (input_tx, input_rx) = mpsc::channel(WORKER_INPUTS_QUEUED_MAX);
        let (completion_tx, completion_rx) = mpsc::unbounded_channel();
        inputs.push(input_tx);
        completions.push(completion_tx);
        let worker = Worker {
            groups: BTreeMap::new(),
            log: log.clone(),
            outbox: Outbox::default(),
            touched: Vec::new(),
            leases: Vec::new(),
        };
        tasks.push(tokio::spawn(worker.run(tick, input_rx, completion_rx)));
    }
    (
        Workers {
            inputs: inputs.into(),
            completions: completions.into(),
        },
        tasks,
    )
}

struct Worker {
    groups: BTreeMap<GroupId, Box<dyn GroupRun>>,
    log: mpsc::Sender<LogRequest>,
    outbox: Outbox,
    /// Groups given batched inputs this turn, to flush before waiting
    /// (at most [`INPUTS_PER_TURN_MAX`] + 1 entries, duplicates allowed).
    touched: Vec<GroupId>,
    /// The inbound budget of the messages batched this turn, given back
    /// once they are stepped.
    leases: Vec<BufferLease>,
}

impl Worker {
    async fn run(
        mut self,
        tick: Duration,
        mut inputs: mpsc::Receiver<WorkerInput>,
        mut completions: mpsc::UnboundedReceiver<(GroupId, Completion)>,
    ) {
        let mut ticker = tokio::time::interval(tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                Some((group, completion)) = completions.recv() => {
                    self.complete(group, completion);
                }
                _ = ticker.tick() => {
                    for run in self.groups.values_mut() {
                        run.tick(&mut self.outbox);
                    }
                }
                input = inputs.recv() => match input {
                    None => break,
                    Some(input) => self.input(input),
                },
            }
            // Whatever else has arrived joins this turn, so that each group
            // steps it as one batch (see `Group::enqueue`).
            let mut taken = 0;
            while taken < INPUTS_PER_TURN_MAX {
                if let Ok((group, completion)) = completions.try_recv() {
                    self.complete(group, completion);
                } else if let Ok(input) = inputs.try_recv() {
                    self.input(input);
                } else {
                    break;
                }
                taken += 1;
            }
            // One flush per group, however many inputs it took (`touch`
            // skips repeats in a row; the rest go here).
            self.touched.sort_unstable();
            self.touched.dedup();
            for group in self.touched.drain(..) {
                if let Some(run) = self.groups.get_mut(&group) {
                    run.flush(&mut self.outbox);
                }
            }
            self.leases.clear();
            for request in self.outbox.log.drain(..) {
                if self.log.send(request).await.is_err() {
                    // The log stopped (a storage failure): nothing can be
                    // made durable any more, so nothing may go on.
                    for run in self.groups.values_mut() {
                        run.stop();
                    }
                    return;
                }
            }
        }
        for run in self.groups.values_mut() {
            run.stop();
        }
    }

    fn complete(&mut self, group: GroupId, completion: Completion) {
        if let Some(run) = self.groups.get_mut(&group) {
            run.complete(completion, &mut self.outbox);
            touch(&mut self.touched, group);
        }
    }

    fn input(&mut self, input: WorkerInput) {
        match input {
            WorkerInput::Message(message, lease) => {
                match self.groups.get_mut(&message.group) {
                    Some(run) => {
                        touch(&mut self.touched, message.group);
                        self.leases.push(lease);
                        run.message(message, &mut self.outbox)
                    }
                    // A group not (or no longer) running here: its peers'
                    // timers send again once it runs.
                    None => tracing::trace!(
                        group = message.group,
                        "message for a group not running here"
                    ),
                }
            }
            WorkerInput::PeerConnected(peer) => {
                for run in self.groups.values_mut() {
                    run.peer(peer, true, &mut self.outbox);
                }
            }
            WorkerInput::PeerDisconnected(peer) => {
                for run in self.groups.values_mut() {
                    run.peer(peer, false, &mut self.outbox);
                }
            }
            WorkerInput::Call { group, call } => match self.groups.get_mut(&group) {
                Some(run) => {
                    touch(&mut self.touched, group);
                    run.call(call, &mut self.outbox)
                }
                // Dropping the call drops its reply sender: the caller
                // sees the group as not running.
                None => drop(call),
            },
            WorkerInput::Start {
                group,
                mut runner,
                reply,
            } => {
                if self.groups.contains_key(&group) {
                    let _ = reply.send(Err(GroupError::AlreadyRunning { group }));
                    return;
                }
                // The first tick applies what the log holds beyond the
                // snapshot before any call is served.
                runner.tick(&mut self.outbox);
                self.groups.insert(group, runner);
                let _ = reply.send(Ok(()));
            }
            WorkerInput::Stop { group, reply } => match self.groups.remove(&group) {
                Some(mut run) => {
                    run.stop();
                    let _ = reply.send(Ok(()));
                }
                None => {
                    let _ = reply.send(Err(GroupError::NotRunning { group }));
                }
            },
        }
    }
}

/// Notes that `group` took an input this turn and must be flushed; a repeat
/// of the last one is skipped here, the rest when the turn ends.
fn touch(touched: &mut Vec<GroupId>, group: GroupId) {
    if touched.last() != Some(&group) {
        touched.push(group);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A group that records what the worker hands it.
    struct Recorder {
        seen: Arc<Mutex<Vec<&'static str>>>,
    }

    impl Recorder {
        fn note(&self, what: &'static str) {
            self.seen.lock().expect("not poisoned").push(what);
        }
    }

    impl GroupRun for Recorder {
        fn message(&mut self, _: Message, _: &mut Outbox) {
            self.note("message");
        }
        fn peer(&mut self, _: NodeId, _: bool, _: &mut Outbox) {
            self.note("peer");
        }
        fn call(&mut self, _: Box<dyn Any + Send>, _: &mut Outbox) {
            self.note("call");
        }
        fn tick(&mut self, _: &mut Outbox) {}
        fn complete(&mut self, _: Completion, _: &mut Outbox) {
            self.note("complete");
        }
        fn flush(&mut self, _: &mut Outbox) {
            self.note("flush");
        }
        fn stop(&mut self) {
            self.note("stop");
        }
    }

    /// What arrives while a worker is busy is taken in its next turn as
    /// one batch: each group is flushed once for all of it (so proposals
    /// arriving together share one persist request and one append per
    /// follower), and the turn is bounded.
    #[tokio::test(flavor = "current_thread")]
    async fn inputs_that_arrive_together_are_stepped_as_one_batch_per_turn() {
        let (log, _log_requests) = mpsc::channel(16);
        let (workers, _tasks) = spawn(1, Duration::from_secs(3600), log);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (reply, started) = oneshot::channel();
        let runner = Box::new(Recorder { seen: seen.clone() });
        assert!(
            workers
                .input(
                    7,
                    WorkerInput::Start {
                        group: 7,
                        runner,
                        reply
                    }
                )
                .await
        );
        started.await.expect("answered").expect("started");
        // The worker does not run while this task sends (one thread).
        let sent = INPUTS_PER_TURN_MAX + 10;
        for _ in 0..sent {
            let call = Box::new(());
            assert!(workers.input(7, WorkerInput::Call { group: 7, call }).await);
        }
        workers.complete(7, Completion::Persisted { seq: 1 });
        while seen
            .lock()
            .expect("not poisoned")
            .iter()
            .filter(|s| **s != "flush")
            .count()
            < sent + 1
        {
            tokio::task::yield_now().await;
        }
        let seen = seen.lock().expect("not poisoned").clone();
        // Each turn ends with one flush for all it took, and takes at most
        // the bound beyond the input it woke for.
        assert_eq!(seen.last(), Some(&"flush"), "{seen:?}");
        let turns: Vec<&[&str]> = seen.split(|s| *s == "flush").collect();
        assert!(
            turns[..turns.len() - 1].iter().all(|turn| !turn.is_empty()),
            "{seen:?}"
        );
        assert!(
            turns
                .iter()
                .all(|turn| turn.len() <= INPUTS_PER_TURN_MAX + 1),
            "{seen:?}"
        );
        assert!(
            turns.len() - 1 <= 4,
            "{} turns for {sent} inputs",
            turns.len() - 1
        );
        // The completion, taken first in its turn, is in the batch too.
        assert_eq!(seen.iter().filter(|s| **s == "complete").count(), 1);
    }
}
