//! An in-process test cluster: nodes stepped by function call, messages
//! delivered from a queue the test can drop, reorder or duplicate from,
//! in-memory storage that confirms persists when told to (or at once), and a
//! tiny state machine (the list of applied commands). Used by the engine's
//! scenario tests and its benchmark.
//!
//! The harness checks as it goes: every node applies a contiguous sequence,
//! every node applies the same entry at the same index (state machine
//! safety), and every request is answered at most once.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;

use crate::io::{Action, Input, PersistRequest};
use crate::message::{Message, MessageBody};
use crate::options::Options;
use crate::request::{Request, RequestError, RequestId, Response, Role};
use crate::types::{
    Entry, EntryPayload, HardState, Index, LogOutline, NodeId, RestoredState, SnapshotMeta, Term,
};
use crate::RaftNode;

/// What a node's storage holds (what survives a crash).
#[derive(Clone, Debug, Default)]
pub struct MemStorage {
    /// Synced hard state.
    pub hard_state: HardState,
    /// Synced entries after the snapshot.
    pub entries: Vec<Entry>,
    /// The installed or built snapshot.
    pub snapshot: SnapshotMeta,
    /// The snapshot's bytes (the encoded state machine).
    pub snapshot_data: Bytes,
    /// The state machine's applied index as of the snapshot.
    pub snapshot_applied: Vec<Bytes>,
}

impl MemStorage {
    /// Synced entries `from..=through`, at most about `max_bytes` of them
    /// (at least one), or `None` if `from` is not stored.
    pub fn load(&self, from: Index, through: Index, max_bytes: u64) -> Option<Vec<Entry>> {
        // Found by index: the stored entries may have a gap where the
        // snapshot covered an entry before it was written (it is skipped).
        let start = self.entries.binary_search_by_key(&from, |e| e.index).ok()?;
        let mut bytes = 0u64;
        let mut out = Vec::new();
        let wanted = self.entries[start..].iter().zip(from..);
        for (entry, _) in wanted.take_while(|(e, i)| e.index == *i && e.index <= through) {
            bytes = bytes.saturating_add(entry.size_bytes());
            if !out.is_empty() && bytes > max_bytes {
                break;
            }
            out.push(entry.clone());
        }
        Some(out)
    }

    fn write(&mut self, request: &PersistRequest) {
        if let Some(hard_state) = request.hard_state {
            self.hard_state = hard_state;
        }
        // Entries at or below the snapshot (the state machine may snapshot
        // committed entries before this node's own copy is written) are
        // covered by it already.
        let snapshot_index = self.snapshot.index;
        let entries: Vec<&Entry> = request
            .entries
            .iter()
            .filter(|e| e.index > snapshot_index)
            .collect();
        if let Some(first) = entries.first() {
            self.entries.retain(|e| e.index < first.index);
            let stored_last = self
                .entries
                .last()
                .map_or(0, |e| e.index)
                .max(self.snapshot.index);
            assert_eq!(
                stored_last + 1,
                first.index,
                "persist would leave a gap in the stored log"
            );
            self.entries.extend(entries.into_iter().cloned());
        }
    }
}

/// One node of the test cluster with its storage and state machine.
#[derive(Debug)]
pub struct TestNode {
    /// The engine.
    pub raft: RaftNode,
    /// Durable storage.
    pub storage: MemStorage,
    /// Persist requests written but not yet synced, oldest first.
    pub unsynced: VecDeque<PersistRequest>,
    /// The state machine: commands applied, in order (one per applied entry,
    /// empty bytes for no-ops and config entries).
    pub applied: Vec<Bytes>,
    /// The state machine's applied index.
    pub applied_index: Index,
    /// Answers given to clients of this node.
    pub responses: BTreeMap<RequestId, Result<Response, RequestError>>,
    /// Local inputs (storage completions) waiting to be fed back.
    pub local: VecDeque<Input>,
    /// Snapshot being received: (meta, bytes so far).
    pub receiving: Option<(SnapshotMeta, Vec<u8>)>,
    /// Whether the engine said this node was removed.
    pub removed_seen: usize,
    /// Whether this node is up.
    pub up: bool,
    /// Fail the next snapshot chunk saves.
    pub fail_snapshot_saves: bool,
    /// Hold snapshot chunk saves instead of completing them.
    pub hold_snapshot_saves: bool,
    /// Snapshot chunk saves held.
    pub held_saves: VecDeque<Input>,
    /// The highest persist seq synced by this engine instance.
    pub synced_seq: u64,
    /// Every fault the engine reported.
    pub faults: Vec<crate::Fault>,
    /// Entry loads ([`Action::LoadEntries`]) carried out.
    pub entry_loads: u64,
    /// Hold entry loads' answers instead of feeding them back.
    pub hold_entry_loads: bool,
    /// Entry load answers held.
    pub held_loads: VecDeque<Input>,
    /// Answer entry loads with `None` (as if storage had compacted them).
    pub fail_entry_loads: bool,
}

/// The test cluster.
#[derive(Debug)]
pub struct Cluster {
    /// The nodes by id.
    pub nodes: BTreeMap<NodeId, TestNode>,
    /// Messages in flight, delivered in order unless the test interferes.
    pub network: VecDeque<Message>,
    /// Links that drop everything: (from, to).
    pub blocked: BTreeSet<(NodeId, NodeId)>,
    /// Confirm persists as soon as they are requested.
    pub auto_sync: bool,
    /// Committed entries seen applied by any node: index -> (term, payload).
    pub committed: BTreeMap<Index, (Term, EntryPayload)>,
    /// Every message ever sent, when recording is on.
    pub sent_log: Vec<Message>,
    /// Record sent messages in `sent_log`.
    pub record: bool,
    next_request: u64,
}

/// The options the test cluster uses for node `id`.
pub fn test_options(id: NodeId) -> Options {
    let mut options = Options::new(id, 1);
    options.snapshot_chunk_bytes = 16;
    options.compaction_lag_entries = 0;
    options
}

/// Encodes a state machine (list of commands) as snapshot bytes.
pub fn encode_state(applied: &[Bytes]) -> Bytes {
    let mut out = Vec::new();
    for command in applied {
        out.extend_from_slice(&(command.len() as u32).to_le_bytes());
        out.extend_from_slice(command);
    }
    Bytes::from(out)
}

/// Decodes snapshot bytes made by [`encode_state`].
pub fn decode_state(data: &[u8]) -> Option<Vec<Bytes>> {
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        let (len, tail) = rest.split_at_checked(4)?;
        let len = u32::from_le_bytes(len.try_into().ok()?) as usize;
        let (command, tail) = tail.split_at_checked(len)?;
        out.push(Bytes::copy_from_slice(command));
        rest = tail;
    }
    Some(out)
}

impl Cluster {
    /// A new group of `voters` with default test options and auto-sync.
    pub fn new(voters: &[NodeId]) -> Self {
        Self::with_options(voters, test_options)
    }

    /// A new group of `voters`, each node's options made by `options`.
    pub fn with_options(voters: &[NodeId], options: impl Fn(NodeId) -> Options) -> Self {
        let mut cluster = Cluster {
            nodes: BTreeMap::new(),
            network: VecDeque::new(),
            blocked: BTreeSet::new(),
            auto_sync: true,
            committed: BTreeMap::new(),
            sent_log: Vec::new(),
            record: false,
            next_request: 1,
        };
        for &id in voters {
            let restored = RestoredState::bootstrap(voters.iter().copied());
            cluster.add_node(id, options(id), restored);
        }
        cluster
    }

    /// Adds a node (e.g. one joining with [`RestoredState::joining`]).
    pub fn add_node(&mut self, id: NodeId, options: Options, restored: RestoredState) {
        let storage = MemStorage {
            hard_state: restored.hard_state,
            entries: restored.entries.clone(),
            snapshot: restored.snapshot.clone(),
            ..MemStorage::default()
        };
        let raft = RaftNode::new(options, restored, id * 7919).expect("valid test node");
        self.nodes.insert(
            id,
            TestNode {
                raft,
                storage,
                unsynced: VecDeque::new(),
                applied: Vec::new(),
                applied_index: 0,
                responses: BTreeMap::new(),
                local: VecDeque::new(),
                receiving: None,
                removed_seen: 0,
                up: true,
                fail_snapshot_saves: false,
                hold_snapshot_saves: false,
                held_saves: VecDeque::new(),
                synced_seq: 0,
                faults: Vec::new(),
                entry_loads: 0,
                hold_entry_loads: false,
                held_loads: VecDeque::new(),
                fail_entry_loads: false,
            },
        );
    }

    /// The node `id`.
    pub fn node(&self, id: NodeId) -> &TestNode {
        &self.nodes[&id]
    }

    /// The engine of node `id`.
    pub fn raft(&self, id: NodeId) -> &RaftNode {
        &self.nodes[&id].raft
    }

    /// Feeds one input to node `id` and carries out what it asks.
    pub fn step(&mut self, id: NodeId, input: Input) {
        self.step_batch(id, vec![input]);
    }

    /// Feeds several inputs to node `id` at once (batched flush).
    pub fn step_batch(&mut self, id: NodeId, inputs: Vec<Input>) {
        let mut actions = Vec::new();
        {
            let Some(node) = self.nodes.get_mut(&id) else {
                return;
            };
            if !node.up {
                return;
            }
            node.raft.step_batch(inputs, &mut actions);
        }
        self.carry_out(id, actions);
        // Feed back local completions (storage) until there are none.
        let mut rounds = 0;
        loop {
            let Some(node) = self.nodes.get_mut(&id) else {
                return;
            };
            let Some(input) = node.local.pop_front() else {
                break;
            };
            rounds += 1;
            assert!(rounds < 100_000, "local completions do not settle");
            let mut actions = Vec::new();
            node.raft.step(input, &mut actions);
            self.carry_out(id, actions);
        }
    }

    fn carry_out(&mut self, id: NodeId, actions: Vec<Action>) {
        for action in actions {
            self.carry_out_one(id, action);
        }
    }

    fn carry_out_one(&mut self, id: NodeId, action: Action) {
        let auto_sync = self.auto_sync;
        match action {
            Action::Persist(request) => {
                let node = self.nodes.get_mut(&id).expect("node");
                assert_eq!(
                    request.seq,
                    node.unsynced
                        .back()
                        .map_or(node.storage_seq_next(), |r| r.seq + 1)
                );
                node.unsynced.push_back(request);
                if auto_sync {
                    node.sync_all();
                }
            }
            Action::Send(message) => {
                assert_eq!(message.from, id);
                if self.record {
                    self.sent_log.push(message.clone());
                }
                if !self.blocked.contains(&(message.from, message.to)) {
                    self.network.push_back(message);
                }
            }
            Action::Apply(entries) => {
                for entry in entries {
                    let node = self.nodes.get_mut(&id).expect("node");
                    assert_eq!(
                        entry.index,
                        node.applied_index + 1,
                        "node {id} applied out of order"
                    );
                    node.applied_index = entry.index;
                    node.applied.push(match &entry.payload {
                        EntryPayload::Command(data) => data.clone(),
                        EntryPayload::Noop | EntryPayload::Config(_) => Bytes::new(),
                    });
                    match self.committed.get(&entry.index) {
                        Some((term, payload)) => assert!(
                            *term == entry.term && *payload == entry.payload,
                            "state machine safety violated at index {}: node {id} applied term {} but term {term} was applied elsewhere",
                            entry.index,
                            entry.term
                        ),
                        None => {
                            self.committed.insert(entry.index, (entry.term, entry.payload.clone()));
                        }
                    }
                }
            }
            Action::Respond {
                id: request,
                result,
            } => {
                let node = self.nodes.get_mut(&id).expect("node");
                assert!(
                    node.responses.insert(request, result).is_none(),
                    "request {request:?} on node {id} answered twice"
                );
            }
            Action::LoadSnapshotChunk {
                to,
                snapshot_index,
                offset,
                max_bytes,
            } => {
                let node = self.nodes.get_mut(&id).expect("node");
                let chunk = if node.storage.snapshot.index == snapshot_index {
                    let data = &node.storage.snapshot_data;
                    let start = (offset as usize).min(data.len());
                    let end = (start + max_bytes as usize).min(data.len());
                    Some((data.slice(start..end), end == data.len()))
                } else {
                    None
                };
                node.local.push_back(Input::SnapshotChunkLoaded {
                    to,
                    snapshot_index,
                    offset,
                    chunk,
                });
            }
            Action::LoadEntries {
                to,
                term,
                from,
                through,
                max_bytes,
            } => {
                let node = self.nodes.get_mut(&id).expect("node");
                node.entry_loads += 1;
                let entries = node.storage.load(from, through, max_bytes);
                let input = Input::EntriesLoaded {
                    to,
                    term,
                    from,
                    entries: entries.filter(|_| !node.fail_entry_loads),
                };
                if node.hold_entry_loads {
                    node.held_loads.push_back(input);
                } else {
                    node.local.push_back(input);
                }
            }
            Action::SaveSnapshotChunk {
                meta,
                offset,
                data,
                done,
            } => {
                let node = self.nodes.get_mut(&id).expect("node");
                let snapshot_index = meta.index;
                let mut ok = !node.fail_snapshot_saves;
                if ok {
                    if offset == 0 {
                        node.receiving = Some((meta.clone(), Vec::new()));
                    }
                    match &mut node.receiving {
                        Some((m, buffer))
                            if m.index == meta.index && buffer.len() as u64 == offset =>
                        {
                            buffer.extend_from_slice(&data);
                        }
                        _ => ok = false,
                    }
                }
                if ok && done {
                    // Writes requested before the install reach storage
                    // before the install resets the log (actions in order).
                    node.sync_all();
                    let (meta, buffer) = node.receiving.take().expect("receiving");
                    let state = decode_state(&buffer).expect("snapshot bytes decode");
                    assert_eq!(
                        state.len() as u64,
                        meta.index,
                        "snapshot holds one command per index"
                    );
                    assert!(
                        meta.index > node.applied_index,
                        "a snapshot must never move the state machine back"
                    );
                    node.applied = state.clone();
                    node.applied_index = meta.index;
                    node.storage.snapshot = meta;
                    node.storage.snapshot_data = Bytes::from(buffer);
                    node.storage.snapshot_applied = state;
                    node.storage.entries.clear();
                }
                let input = Input::SnapshotChunkSaved {
                    snapshot_index,
                    offset,
                    ok,
                };
                if node.hold_snapshot_saves {
                    node.held_saves.push_back(input);
                } else {
                    node.local.push_back(input);
                }
            }
            Action::Compact { through } => {
                let node = self.nodes.get_mut(&id).expect("node");
                node.storage.entries.retain(|e| e.index > through);
            }
            Action::RoleChanged { .. } => {}
            Action::Removed => {
                self.nodes.get_mut(&id).expect("node").removed_seen += 1;
            }
            Action::Fault(fault) => {
                self.nodes.get_mut(&id).expect("node").faults.push(fault);
            }
        }
    }

    /// Confirms every outstanding persist of node `id`.
    pub fn sync(&mut self, id: NodeId) {
        let seq = {
            let node = self.nodes.get_mut(&id).expect("node");
            node.sync_all()
        };
        let _ = seq;
        let node = self.nodes.get_mut(&id).expect("node");
        let pending: Vec<Input> = node.local.drain(..).collect();
        for input in pending {
            self.step(id, input);
        }
    }

    /// Feeds node `id` the entry load answers it holds.
    pub fn release_loads(&mut self, id: NodeId) {
        let node = self.nodes.get_mut(&id).expect("node");
        let held: Vec<Input> = node.held_loads.drain(..).collect();
        for input in held {
            self.step(id, input);
        }
    }

    /// Completes the snapshot chunk saves held on node `id`.
    pub fn release_saves(&mut self, id: NodeId) {
        let node = self.nodes.get_mut(&id).expect("node");
        let held: Vec<Input> = node.held_saves.drain(..).collect();
        for input in held {
            self.step(id, input);
        }
    }

    /// Delivers one message from the front of the network queue.
    pub fn deliver_one(&mut self) -> bool {
        let Some(message) = self.network.pop_front() else {
            return false;
        };
        let to = message.to;
        if self.nodes.get(&to).is_some_and(|n| n.up) {
            self.step(to, Input::Message(message));
        }
        true
    }

    /// Delivers messages until none are in flight (bounded).
    pub fn deliver_all(&mut self) {
        let mut delivered = 0;
        while self.deliver_one() {
            delivered += 1;
            assert!(delivered < 1_000_000, "message storm");
        }
    }

    /// Delivers messages until none are in flight, dropping those for
    /// which `keep` says false (bounded).
    pub fn deliver_filtered(&mut self, mut keep: impl FnMut(&Message) -> bool) -> usize {
        let mut dropped = 0;
        let mut delivered = 0;
        while let Some(message) = self.network.pop_front() {
            delivered += 1;
            assert!(delivered < 1_000_000, "message storm");
            if !keep(&message) {
                dropped += 1;
                continue;
            }
            let to = message.to;
            if self.nodes.get(&to).is_some_and(|n| n.up) {
                self.step(to, Input::Message(message));
            }
        }
        dropped
    }

    /// Drops every message in flight.
    pub fn drop_all(&mut self) -> usize {
        let n = self.network.len();
        self.network.clear();
        n
    }

    /// Ticks every up node once, then delivers everything.
    pub fn tick_all(&mut self) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in ids {
            self.step(id, Input::Tick);
        }
        self.deliver_all();
    }

    /// Ticks until `pred` holds (checked after each round), at most `max` rounds.
    pub fn run_until(&mut self, max: usize, pred: impl Fn(&Cluster) -> bool) -> bool {
        for _ in 0..max {
            if pred(self) {
                return true;
            }
            self.tick_all();
        }
        pred(self)
    }

    /// Runs until some node is leader; returns it.
    pub fn elect(&mut self) -> NodeId {
        assert!(
            self.run_until(500, |c| c.leader().is_some()),
            "no leader elected"
        );
        self.leader().expect("leader")
    }

    /// The leader with the highest term among up nodes, if any.
    pub fn leader(&self) -> Option<NodeId> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.up && n.raft.role() == Role::Leader)
            .max_by_key(|(_, n)| n.raft.term())
            .map(|(&id, _)| id)
    }

    /// Sends a client request to node `id`; returns its id.
    pub fn request(&mut self, id: NodeId, request: Request) -> RequestId {
        let request_id = RequestId(self.next_request);
        self.next_request += 1;
        self.step(
            id,
            Input::Client {
                id: request_id,
                request,
            },
        );
        request_id
    }

    /// Proposes `data` at node `id`.
    pub fn propose(&mut self, id: NodeId, data: &str) -> RequestId {
        self.request(
            id,
            Request::Propose(Bytes::copy_from_slice(data.as_bytes())),
        )
    }

    /// The answer node `id` gave to `request`, if any.
    pub fn response(
        &self,
        id: NodeId,
        request: RequestId,
    ) -> Option<&Result<Response, RequestError>> {
        self.nodes[&id].responses.get(&request)
    }

    /// Takes a snapshot of node `id`'s state machine and tells the engine.
    pub fn snapshot(&mut self, id: NodeId) {
        let node = self.nodes.get_mut(&id).expect("node");
        let index = node.applied_index;
        let term = node.raft.term_at(index).expect("applied entry term known");
        let data = encode_state(&node.applied);
        node.storage.snapshot = SnapshotMeta {
            index,
            term,
            config: node.raft.config().clone(),
        };
        node.storage.snapshot_data = data;
        node.storage.snapshot_applied = node.applied.clone();
        self.step(id, Input::SnapshotBuilt { index });
    }

    /// Blocks both directions between `a` and `b`.
    pub fn partition(&mut self, a: NodeId, b: NodeId) {
        self.blocked.insert((a, b));
        self.blocked.insert((b, a));
    }

    /// Cuts `id` off from every other node.
    pub fn isolate(&mut self, id: NodeId) {
        let others: Vec<NodeId> = self.nodes.keys().copied().filter(|&o| o != id).collect();
        for other in others {
            self.partition(id, other);
        }
    }

    /// Unblocks both directions between `a` and `b`.
    pub fn heal_pair(&mut self, a: NodeId, b: NodeId) {
        self.blocked.remove(&(a, b));
        self.blocked.remove(&(b, a));
    }

    /// Removes every blocked link.
    pub fn heal(&mut self) {
        self.blocked.clear();
    }

    /// Crashes node `id`: unsynced writes are lost, the engine restarts
    /// from storage.
    pub fn restart(&mut self, id: NodeId) {
        let node = self.nodes.get_mut(&id).expect("node");
        node.unsynced.clear();
        node.local.clear();
        node.receiving = None;
        let storage = node.storage.clone();
        let options = node.raft.options.clone();
        let restored = RestoredState {
            hard_state: storage.hard_state,
            snapshot: storage.snapshot.clone(),
            entries: storage.entries.clone(),
            outline: None,
            applied: storage.snapshot.index,
        };
        node.synced_seq = 0;
        node.applied = storage.snapshot_applied.clone();
        node.applied_index = storage.snapshot.index;
        node.raft = RaftNode::new(options, restored, id * 31 + 5).expect("restart");
    }

    /// Crashes node `id` like [`Cluster::restart`], but as a node whose
    /// state machine is durable: it keeps what it applied (up to its synced
    /// log's end), and the engine is given the log's outline and only the
    /// entries after that applied point, the rest staying in storage.
    pub fn restart_keeping_applied(&mut self, id: NodeId) {
        let node = self.nodes.get_mut(&id).expect("node");
        node.unsynced.clear();
        node.local.clear();
        node.receiving = None;
        let storage = node.storage.clone();
        let options = node.raft.options.clone();
        let stored_last = storage
            .entries
            .last()
            .map_or(storage.snapshot.index, |e| e.index);
        let applied = node
            .applied_index
            .min(stored_last)
            .max(storage.snapshot.index);
        let mut outline = LogOutline::of(&storage.entries);
        outline.last_index = stored_last;
        let restored = RestoredState {
            hard_state: storage.hard_state,
            snapshot: storage.snapshot.clone(),
            entries: storage
                .entries
                .iter()
                .filter(|e| e.index > applied)
                .cloned()
                .collect(),
            outline: Some(outline),
            applied,
        };
        node.synced_seq = 0;
        node.applied
            .truncate(usize::try_from(applied).expect("small"));
        node.applied_index = applied;
        node.raft = RaftNode::new(options, restored, id * 31 + 7).expect("restart");
    }

    /// Whether every up node has applied at least `index`.
    pub fn all_applied(&self, index: Index) -> bool {
        self.nodes
            .values()
            .filter(|n| n.up)
            .all(|n| n.applied_index >= index)
    }

    /// Messages in flight matching `pred`.
    pub fn in_flight(&self, pred: impl Fn(&Message) -> bool) -> usize {
        self.network.iter().filter(|m| pred(m)).count()
    }

    /// Whether the body is a client-traffic message.
    pub fn is_forward(message: &Message) -> bool {
        matches!(
            message.body,
            MessageBody::Forward { .. } | MessageBody::ForwardResponse { .. }
        )
    }
}

impl TestNode {
    fn storage_seq_next(&self) -> u64 {
        // The engine's first persist of a fresh instance is seq 1.
        self.synced_seq + 1
    }

    /// Writes and syncs every outstanding persist; queues the completion.
    fn sync_all(&mut self) -> u64 {
        let mut last = None;
        while let Some(request) = self.unsynced.pop_front() {
            self.storage.write(&request);
            last = Some(request.seq);
        }
        if let Some(seq) = last {
            self.synced_seq = seq;
            self.local.push_back(Input::Persisted { seq });
        }
        self.synced_seq
    }
}
