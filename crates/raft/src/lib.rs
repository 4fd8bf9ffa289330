//! # ferry-raft: the consensus engine
//!
//! A pure, deterministic Raft engine: it does no I/O, reads no clock and
//! spawns nothing. Time arrives as [`Input::Tick`]; randomness comes from a
//! seeded generator; everything the engine wants done comes back as an
//! [`Action`]. The same engine runs under the real runtime and under the
//! simulator, and a seed reproduces a run exactly.
//!
//! One [`RaftNode`] is one member of one group, identified by (group id,
//! node id); a process hosts as many as it likes. The runtime calls
//! [`RaftNode::step`] (or [`RaftNode::step_batch`], which groups the work
//! of several inputs into one persist request and one append per follower)
//! and carries out the returned actions in order.
//!
//! ## What the engine guarantees the runtime
//!
//! * **Durable before acknowledged.** Term, vote and entries go out as
//!   [`Action::Persist`] with increasing `seq` (from 1 for every new
//!   instance). Vote grants, append and heartbeat answers and the snapshot
//!   `Installed` answer wait inside the engine until [`Input::Persisted`]
//!   covers everything decided before them. A candidate counts its own vote
//!   only once it is durable. The leader sends appends in parallel with its
//!   own persist and counts itself toward commit only for entries its own
//!   storage has synced (with the term at that index checked).
//! * **Commit** only by counting replicas of an entry of the leader's own
//!   term (each leader appends a no-op first); joint configurations need a
//!   majority of each half. Followers hear of a new commit index at once:
//!   with the next entries, or else in a commit notice (a heartbeat with
//!   `read_seq` 0, [`COMMIT_NOTICE_READ_SEQ`], which is not answered), so
//!   that their applies (what serializable reads and watches on them see)
//!   do not lag by a heartbeat interval.
//! * **Apply**: [`Action::Apply`] carries committed entries in order,
//!   no-ops and configuration entries included, so the applied index is
//!   contiguous. On start, entries in `(restored.applied, commit]` are
//!   applied again. The engine may hand an entry to the state machine before
//!   its own copy is synced (it is committed, so a quorum has it).
//! * **Log in memory**: the engine keeps the entries after the last
//!   compaction point; [`Input::SnapshotBuilt`] moves the snapshot and
//!   compacts to `index - compaction_lag_entries` ([`Action::Compact`]),
//!   but never beyond what this node's own storage has synced (a persist
//!   request may still carry entries a snapshot already covers: storage
//!   skips entries at or below its snapshot). [`RestoredState::entries`]
//!   may start at or before the snapshot index; entries it covers are
//!   skipped.
//! * **Memory bound on the log**, independent of snapshots: the log holds
//!   at most `Options::log_memory_bytes_max` bytes and
//!   `log_memory_entries_max` entries of *settled* entries (durable here
//!   and already handed out in [`Action::Apply`]); older settled bodies are
//!   evicted and live only in storage. Entries not yet durable or not yet
//!   applied always stay (the engine must still hand them to storage or
//!   the state machine, and storage may not have them to give back). An
//!   evicted entry is still part of the log: the log keeps the first index
//!   of each term (term runs) and every configuration entry, so term
//!   lookups, conflict checks, append hints, commit-term checks and
//!   configuration lookups cover the whole log. When a follower needs
//!   evicted entries the leader emits [`Action::LoadEntries`] (at most one
//!   per follower at a time) and sends them when [`Input::EntriesLoaded`]
//!   brings them, after checking them against its term runs and
//!   configurations (a mismatch is [`Fault::LoadedEntriesInvalid`]; nothing
//!   is sent and the next heartbeat round asks again) and that the answer
//!   is for this term and the follower's current next index (otherwise it
//!   is dropped). `None` (storage compacted them) sends the snapshot if it
//!   covers them, else (a failed read) the next heartbeat round asks again. A
//!   lost answer is asked for again as a lost probe is resent: in probe
//!   the next heartbeat round forgets the load, in replicate a stalled
//!   follower goes back to probe.
//! * **Restart** needs the bodies only from the applied point on: with a
//!   [`LogOutline`] (last index, term runs, configuration entries of the
//!   whole log) in [`RestoredState::outline`], `entries` may be the tail
//!   after `applied` (those are applied again on start, so they must be at
//!   hand; the engine refuses a tail that starts later). A runtime with an
//!   in-memory state machine restores it from its snapshot and so passes
//!   the log after the snapshot, which the bound trims once applied; a
//!   durable state machine passes only what it has not applied. There is no
//!   load for applying: an [`Action::Apply`] always carries bodies the
//!   engine holds, so it is carried out in order like any other action.
//! * **Configuration** changes take effect when committed (etcd style); at
//!   most one is uncommitted; voter changes go through a joint configuration
//!   and the leader appends the leave-joint entry itself once the joint one
//!   commits (also a new leader that inherits a committed joint config).
//!   A learner can be promoted once its match index is within
//!   [`PROMOTE_LAG_ENTRIES_MAX`] of the leader's last index. A node that sees
//!   a committed configuration without itself (having been a member) emits
//!   [`Action::Removed`] once, never campaigns again and answers every
//!   request but status with [`RequestError::Removed`]. The leader keeps
//!   replicating to a removed member for a few election timeouts so that it
//!   learns of its removal; a leader that is no longer a voter steps down once
//!   that configuration commits. Since commit indexes travel with the
//!   leader's messages, voters can disagree after a leader crash on which
//!   configuration is in force; every vote answer therefore carries the
//!   voter's commit index (and its entry's term), and a candidate whose log
//!   holds that entry takes it as committed, so that it counts votes under
//!   the configuration the group really has.
//!
//! ## Liveness by construction (the seeds)
//!
//! * Every replication state of a follower on the leader is left by a
//!   message from that follower or by a timeout: probe (one append, resent
//!   on every heartbeat answer), replicate (a heartbeat answer with the match
//!   index stuck for three rounds while entries are outstanding sends the
//!   follower back to probe; a full window is freed one slot per heartbeat
//!   answer), snapshot (left on `SnapshotResponse` — `Installed`, `Stale` or
//!   `Rejected` — or on any append answer; chunks are pipelined under the
//!   same window as appends, `inflight_messages_max` chunks and
//!   `inflight_bytes_max` bytes beyond the follower's acknowledged offset; a
//!   follower that answers a chunk after a gap with its own offset gets the
//!   rest again from there, once per offset; with no progress for
//!   `snapshot_chunk_timeout_ticks` the leader resends from the last
//!   acknowledged offset, and after three such timeouts in a row it probes
//!   afresh). Nothing local is ever needed (seed 004). A follower saves
//!   chunks one at a time, in order, and queues those that arrive meanwhile
//!   (bounded by its own window); a transfer is one leader's sending of one
//!   snapshot in one term, so a late chunk 0 of the same transfer does not
//!   restart it, and a new leader's transfer starts afresh.
//! * A rejected append carries `(hint_index, hint_term)`; `hint_term == 0`
//!   means the follower cannot tell the term there (empty log, compacted),
//!   and the leader then probes right after `hint_index`. The next index
//!   never falls below `match + 1`, and every reject moves it strictly
//!   below the rejected index, so backtracking ends.
//! * A follower answers a snapshot at or below its commit index (or one
//!   whose last entry it already holds) with `Stale { match_index }` at
//!   once, without saving it.
//! * [`Input::PeerConnected`]: a leader moves the peer to probe and sends it
//!   an append at once (term, commit, identity); a candidate re-sends its
//!   vote request. Any append, heartbeat or snapshot chunk of the current
//!   term makes a node follow its sender, without a new election (seed 002).
//!
//! ## Reads
//!
//! * `Linearizable`: ReadIndex. The leader records its commit index, starts
//!   a heartbeat round (reads arriving together share one) and answers once a
//!   quorum of each half has answered that round; a leader that has not yet
//!   committed an entry of its term waits for its no-op first. A follower
//!   forwards the read and waits until it has applied the returned index.
//!   A leader that steps down fails its pending reads with `LeadershipLost`.
//! * `Lease`: only with `lease_reads && check_quorum` (otherwise
//!   `LeaseReadsDisabled`), only on the leader (a follower answers
//!   `NotLeader`), never during a leadership transfer. If the lease has run
//!   out the read falls back to ReadIndex.
//! * `Local { min_applied }`: answered from the state last applied, or held
//!   until `applied >= min_applied` (deadline: `request_timeout_ticks`, then
//!   `Timeout`). A follower receiving a snapshot answers local reads from the
//!   state it last applied (the snapshot moves it forward once installed).
//!
//! ### The lease's clock assumption
//!
//! A follower that heard from the leader less than `election_timeout_ticks`
//! of *its own* ticks ago refuses to vote for anyone else (unless the leader
//! itself asked, by leadership transfer); with `lease_reads` on, so does a
//! node in its first `election_timeout_ticks` after it starts, since a
//! crash made it forget whom it heard from. Check-quorum makes a leader
//! that lost its quorum step down, so a deposed leader does not keep
//! serving.
//! The leader therefore owns the group until `election_timeout_ticks` after
//! the moment it *sent* a heartbeat round that a quorum answered. The leader
//! measures that time in its own ticks and keeps a margin: a lease lasts
//! [`RaftNode::lease_ticks`] = `election_timeout_ticks - election_timeout_ticks/4 - 1`
//! leader ticks after the round was sent. This is safe as long as no
//! follower's clock runs more than about 25% faster than the leader's
//! (bounded drift; ticks of all nodes measure roughly the same real time)
//! and message delays do not matter (they only shorten the lease). If
//! clocks can jump or drift more, use `Linearizable`.
//!
//! ## Requests
//!
//! Every request gets exactly one [`Action::Respond`]. A request that needs
//! the leader is executed on the leader, forwarded to it (its answer
//! relayed; no answer within `request_timeout_ticks` gives `Timeout`, an
//! unknown outcome), redirected with `NotLeader` when `forward_requests` is
//! off, or held in a queue bounded by `pending_requests_max` (`Busy` beyond)
//! until a leader is known, then forwarded or executed; at the deadline it
//! fails with `NoLeader`. A forwarded request the receiver refuses with
//! `NotLeader` goes back to waiting for the right leader. The linearizable
//! reads a follower routes to the leader in one step (one
//! [`RaftNode::step_batch`]) share one forwarded ReadIndex: the first is
//! forwarded and the others take its answer, which is safe because all of
//! them arrived before the `Forward` left. A leader refuses
//! proposals with `Busy` while its uncommitted tail holds
//! `pending_requests_max` entries, and answers a `Forward` it receives twice
//! (network duplication) with the first outcome instead of proposing again.
//! It remembers what it executed in memory, for its term: a write
//! forwarded in an older term (perhaps a late copy of one it executed
//! before a restart) is neither executed nor answered, and its forwarder,
//! if still waiting, reports `Timeout`.
//! A node that is removed fails the requests that never left it with
//! `Removed`; requests it had already forwarded keep waiting for the
//! leader's answer or their deadline (`Timeout`: the outcome is unknown).
//!
//! `Campaign` starts an election at once (a pre-vote round first when
//! `pre_vote` is on, so a healthy leader keeps its group) and is answered
//! at once, in every state: `Started` on a follower that may campaign,
//! `AlreadyCampaigning` on a (pre-)candidate, `AlreadyLeader` on a leader;
//! a learner, a follower receiving a snapshot and a node whose term is
//! exhausted refuse with [`RequestError::CannotCampaign`] and its reason, a
//! removed node with `Removed`, a halted one with `Halted`. It is never
//! forwarded or held; the election's outcome shows in
//! [`Action::RoleChanged`].
//!
//! ## Quiescence: idle groups cost almost nothing
//!
//! A process may host thousands of groups, most of them idle. With
//! [`Options::quiesce`] on (off by default), an idle group goes quiet: its
//! leader stops sending heartbeats and stops its check-quorum countdown,
//! its followers stop their election timers, and a tick of a quiescent node
//! only advances its clock ([`RaftNode::is_quiescent`] tells).
//!
//! ### Going quiet
//!
//! A leader's group is idle when nothing waits on the leader (no client
//! request, read, forwarded request or leadership transfer), no membership
//! change is under way (not joint, nothing uncommitted, no removed member
//! still being told), every voter and learner has matched the whole log
//! with nothing in flight and no snapshot transfer, the commit index is the
//! last index and the leader's own copy is synced. Once the group has been
//! idle, with no new request or entry, for at least
//! `heartbeat_interval_ticks`, the leader sends
//! [`MessageBody::Quiesce`] (its last index, that entry's term, its commit
//! index) to every member in place of the next heartbeat round and goes
//! quiet. A follower or learner that gets the notice follows the sender as
//! for any message of a leader, takes the commit index as from a heartbeat,
//! and stops its election timer if its log ends at the notice's (index,
//! term), verified against this leader by an append since it (re)started,
//! its commit index is the notice's, it receives no snapshot, no request of
//! its own is waiting, and quiescence is on here too. Otherwise it answers
//! [`MessageBody::WakeUp`], and the leader wakes and sends it an append
//! (which verifies its log, so that it can go quiet next time). A member
//! that never gets the notice keeps its timer: a voter's fires and its
//! campaign wakes the group; a member that cannot campaign (a learner, or
//! a node that joined and has not yet seen the entry adding it commit)
//! sends `WakeUp` instead, once per election timeout, to its leader or, if
//! it knows none (it restarted), to every voter it knows of (otherwise a
//! learner that lost the notice, and the commit index of the last write
//! with it, would stay behind for as long as the group is quiet).
//!
//! ### Waking
//!
//! * Any message but the notice wakes the node it reaches. A woken
//!   follower tells its leader with `WakeUp`, unless the message came from
//!   that leader or the same step sends the leader something anyway (a
//!   forwarded request, a vote request). Two exceptions, both messages
//!   that bring nothing new:
//!   - a quiet leader drops, without waking, a late answer to a heartbeat
//!     or append of its own in this term from a member whose log it knows
//!     matches through the last index, when the answer says just that (a
//!     heartbeat answer with that last index and no append needed, or an
//!     append success there). It needs nothing; waking on it would start
//!     a heartbeat round whose answers, late again on a loaded host, would
//!     wake it forever;
//!   - a quiet follower answers, without waking, a heartbeat or append of
//!     its leader in this term whose commit index is no higher than its
//!     own and whose entries it holds: a late copy of a message sent
//!     before the notice, or a round of a leader that woke for another
//!     reason and needs only the answer. Waking on a late copy would run
//!     the follower's election timer under a leader that is quiet.
//! * A client request wakes the node it reaches; a follower that forwards
//!   it wakes the leader with the forward itself. Requests that leave
//!   nothing behind and need no timer do not wake: `Status`, a local read
//!   that can be answered at once, a lease read refused at once, and
//!   `Campaign` on a leader (a monitor polling status must not keep
//!   thousands of idle groups awake).
//! * A leader wakes on `PeerConnected` of a member (the peer may be behind:
//!   it is probed with an append at once, as always).
//! * Every role change (a new term, a campaign, stepping down) leaves the
//!   quiescent sub-state; a membership change is a request or an entry and
//!   wakes the group like them.
//! * The liveness rule: `PeerDisconnected(leader)` on a quiescent follower
//!   wakes it with its election timer running (it does not tell the
//!   leader, which it cannot reach). A dead leader of an idle group is
//!   thus replaced within the usual bound: the followers' timers fire
//!   within `[election_timeout_ticks, 2 * election_timeout_ticks)` ticks of
//!   the host reporting the leader gone, as they would after its last
//!   heartbeat.
//! * A woken leader sends a heartbeat round at once and starts a fresh
//!   check-quorum window (it must hear from a quorum within an election
//!   timeout of waking). A woken follower's election timer goes on from
//!   where it stopped (the notice had reset it).
//! * A follower that missed the notice (lost) keeps its timer running; when
//!   it fires, its pre-vote wakes the others and the leader, who still
//!   hold the leader's lease and refuse it: the group is awake again without
//!   an election. (Without pre-vote the lost notice costs a term, as a run
//!   of lost heartbeats does: use pre-vote with quiescence.)
//!
//! ### The host's part
//!
//! Nothing is sent in a quiet group, so no member can notice by itself
//! that its leader died. With quiescence on, the host must report
//! [`Input::PeerDisconnected`] to the groups that have that peer as a
//! member within a bounded time after it stops hearing from the peer's
//! node, and [`Input::PeerConnected`] when it hears from it again. That is
//! a node-level liveness signal, one per pair of nodes (the transport's
//! connection with keepalives, or a node heartbeat), not per group: with
//! thousands of groups its cost does not grow with them. With a bound of
//! `D`, a dead quiescent leader is replaced within `D` plus the usual
//! election bound.
//!
//! Where the host cannot tell (a one-way cut, a link that holds messages,
//! a paused peer whose connection stays up), an idle group need not
//! notice: no member of a quiescent group has a request waiting (a member
//! with one refuses to go quiet), so nothing is late while nobody notices.
//! The first request at any member wakes that member, and from then on the
//! normal Raft timers apply: if it hears no leader within an election
//! timeout it campaigns, its vote requests wake the members it reaches, and
//! their timers run too, exactly as in an awake group whose leader's
//! heartbeats stopped; a leader that cannot reach a quorum steps down by
//! check-quorum an election timeout after it woke. Messages a link held
//! wake their receivers once released. (A member asked only through a
//! leader it alone can reach behaves as in an awake group under the same
//! cut: its requests time out and clients retry other members.) The
//! simulator reports `PeerDisconnected` for crashes and for every partition
//! that cuts a pair of nodes both ways, and nothing for one-way cuts,
//! clogged links and pauses, so both cases are exercised.
//!
//! ### Why it is safe
//!
//! Quiescence only suppresses timers: the leader's heartbeat timer and
//! check-quorum countdown, the followers' election timers. It never lets a
//! node vote, append or commit differently: each decision is made by the
//! same code on the same state (the node leaves the sub-state before it
//! handles any message but the notice), and Raft's safety does not depend
//! on timing. In detail:
//!
//! * Votes: a quiescent follower's time since it heard its leader is
//!   frozen below the election timeout, so it refuses to help depose the
//!   leader, exactly as an awake follower of that live, idle leader would
//!   (it would be hearing its heartbeats). Refusing a vote is always safe,
//!   and a woken follower's timer runs on, so the refusal ends an election
//!   timeout after it woke.
//! * Appends and commits: handled as without quiescence. The notice's
//!   commit index is taken as a heartbeat's, capped at what an append of
//!   this leader verified; the leader of an idle group has nothing
//!   uncommitted.
//! * Leases: a quiescent leader sends no rounds, so its lease runs out and
//!   a lease read falls back to ReadIndex, which wakes it; a follower's
//!   promise not to vote only lasts longer.
//! * Check-quorum: a cut-off quiescent leader does not step down, but it
//!   cannot commit or confirm a read without a quorum; on its first request
//!   it wakes and steps down an election timeout later if no quorum
//!   answers, while the followers that lost it elect another leader.
//!
//! In the simulator, `ferry sim --quiesce on` runs every seed with
//! quiescence on and `--quiesce drawn` about half of them (a flag drawn
//! from a stream of its own, so that a seed draws everything else as it
//! always did); the default, `off`, runs every seed exactly as before. The
//! scenarios `quiescent-leader-crash` and `quiescent-follower-partition`
//! stage a dead quiescent leader and a partitioned quiescent follower.
//!
//! ## The state/request matrix
//!
//! What a node does with each kind of input in each role and sub-state.
//! The `matrix` test builds a node in each row, feeds it each column's input
//! and checks the observed outcome equals this table, cell by cell; it
//! also checks that every client request is answered, forwarded, or held
//! and then answered by its deadline. Legend: `ok:X` / `err:X` = the request
//! is answered with that response or error; `send:X` = a message of that
//! kind goes out (answers that need durability after the persist completes);
//! `persist` = a persist request; `held` = the request waits (for a leader,
//! for a quorum round or for apply, always with a deadline);
//! `become:R` = role change; `save-chunk` / `load-chunk` / `compact` =
//! snapshot storage actions; `load-entries` = a load of evicted entries; `-` = nothing to do (see the notes below).
//!
//! | role / sub-state | RequestVote (newer term) | pre-vote RequestVote | RequestVoteResponse (granted) | Append | AppendResponse (success) | Heartbeat | HeartbeatResponse | SnapshotChunk (first) | SnapshotChunkAck | SnapshotResponse (installed) | TimeoutNow | Forward (proposal) | ForwardResponse (unknown id) | Quiesce | WakeUp | any message from an older term | Propose | Read Linearizable | Read Lease | Read Local | Read Local (min_applied ahead) | ChangeMembership | TransferLeadership | Campaign | Status | Tick | Persisted | SnapshotBuilt | SnapshotChunkLoaded | SnapshotChunkSaved | EntriesLoaded | PeerConnected | PeerDisconnected |
//! |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
//! | follower | `-` | `send:PreVoteRefused` | `-` | `persist send:AppendOk` | `-` | `send:HeartbeatResponse` | `-` | `save-chunk` | `-` | `-` | `persist send:RequestVote become:Candidate` | `send:ForwardErr:NotLeader` | `-` | `send:WakeUp` | `-` | `send:HeartbeatResponse` | `send:Forward held` | `send:Forward held` | `err:NotLeader` | `ok:ReadReady` | `held` | `send:Forward held` | `send:Forward held` | `send:PreVote ok:Campaign(Started) become:PreCandidate` | `ok:Status` | `-` | `-` | `compact` | `-` | `-` | `-` | `-` | `-` |
//! | follower quiescent | `send:WakeUp wake` | `send:PreVoteRefused send:WakeUp wake` | `send:WakeUp wake` | `persist send:AppendOk wake` | `wake` | `send:HeartbeatResponse` | `wake` | `save-chunk wake` | `wake` | `wake` | `persist send:RequestVote become:Candidate wake` | `send:ForwardErr:NotLeader send:WakeUp wake` | `wake` | `-` | `wake` | `send:HeartbeatResponse wake` | `send:Forward wake held` | `send:Forward wake held` | `err:NotLeader` | `ok:ReadReady` | `send:WakeUp wake held` | `send:Forward wake held` | `send:Forward wake held` | `send:PreVote ok:Campaign(Started) become:PreCandidate wake` | `ok:Status` | `-` | `-` | `compact` | `-` | `-` | `-` | `-` | `wake` |
//! | follower receiving snapshot | `-` | `send:PreVoteRefused` | `-` | `persist send:AppendOk` | `-` | `send:HeartbeatResponse` | `-` | `save-chunk` | `-` | `-` | `-` | `send:ForwardErr:NotLeader` | `-` | `send:WakeUp` | `-` | `send:HeartbeatResponse` | `send:Forward held` | `send:Forward held` | `err:NotLeader` | `ok:ReadReady` | `held` | `send:Forward held` | `send:Forward held` | `err:CannotCampaign(ReceivingSnapshot)` | `ok:Status` | `-` | `-` | `compact` | `-` | `send:ChunkAck` | `-` | `-` | `-` |
//! | pre-candidate | `persist send:VoteGranted become:Follower` | `send:PreVoteGranted` | `-` | `persist send:AppendOk become:Follower` | `-` | `send:HeartbeatResponse become:Follower` | `-` | `save-chunk become:Follower` | `-` | `-` | `-` | `send:ForwardErr:NotLeader` | `-` | `send:WakeUp become:Follower` | `-` | `send:HeartbeatResponse` | `held` | `held` | `err:NotLeader` | `ok:ReadReady` | `held` | `held` | `held` | `ok:Campaign(AlreadyCampaigning)` | `ok:Status` | `-` | `-` | `compact` | `-` | `-` | `-` | `send:PreVote` | `-` |
//! | candidate | `persist send:VoteGranted become:Follower` | `send:PreVoteGranted` | `send:Append persist become:Leader` | `persist send:AppendOk become:Follower` | `-` | `send:HeartbeatResponse become:Follower` | `-` | `save-chunk become:Follower` | `-` | `-` | `-` | `send:ForwardErr:NotLeader` | `-` | `send:WakeUp become:Follower` | `-` | `send:HeartbeatResponse` | `held` | `held` | `err:NotLeader` | `ok:ReadReady` | `held` | `held` | `held` | `ok:Campaign(AlreadyCampaigning)` | `ok:Status` | `-` | `-` | `compact` | `-` | `-` | `-` | `send:RequestVote` | `-` |
//! | leader | `-` | `send:PreVoteRefused` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `send:Append` | `-` | `send:ForwardOk send:Append persist` | `-` | `-` | `send:Append` | `send:HeartbeatResponse` | `ok:Proposed send:Append persist` | `send:Heartbeat held` | `ok:ReadReady` | `ok:ReadReady` | `held` | `ok:Proposed send:Append persist` | `send:Append ok:TransferStarted` | `ok:Campaign(AlreadyLeader)` | `ok:Status` | `send:Heartbeat` | `-` | `compact` | `-` | `-` | `-` | `send:Append` | `-` |
//! | leader quiescent | `send:Heartbeat wake` | `send:PreVoteRefused send:Heartbeat wake` | `send:Heartbeat wake` | `send:Heartbeat wake` | `-` | `send:Heartbeat wake` | `-` | `send:Heartbeat wake` | `send:Heartbeat wake` | `send:Append send:Heartbeat wake` | `send:Heartbeat wake` | `send:ForwardOk send:Append send:Heartbeat persist wake` | `send:Heartbeat wake` | `-` | `send:Append send:Heartbeat wake` | `send:HeartbeatResponse send:Heartbeat wake` | `ok:Proposed send:Append send:Heartbeat persist wake` | `send:Heartbeat wake held` | `send:Heartbeat wake held` | `ok:ReadReady` | `send:Heartbeat wake held` | `ok:Proposed send:Append send:Heartbeat persist wake` | `send:TimeoutNow ok:TransferStarted send:Heartbeat wake` | `ok:Campaign(AlreadyLeader)` | `ok:Status` | `-` | `-` | `compact` | `-` | `-` | `-` | `send:Append send:Heartbeat wake` | `-` |
//! | leader transferring | `-` | `send:PreVoteRefused` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `send:Append` | `-` | `send:ForwardErr:TransferInProgress` | `-` | `-` | `send:Append` | `send:HeartbeatResponse` | `err:TransferInProgress` | `send:Heartbeat held` | `send:Heartbeat held` | `ok:ReadReady` | `held` | `err:TransferInProgress` | `err:TransferInProgress` | `ok:Campaign(AlreadyLeader)` | `ok:Status` | `send:Heartbeat` | `-` | `compact` | `-` | `-` | `-` | `send:Append` | `-` |
//! | learner | `-` | `send:PreVoteRefused` | `-` | `persist send:AppendOk` | `-` | `send:HeartbeatResponse` | `-` | `save-chunk` | `-` | `-` | `-` | `send:ForwardErr:NotLeader` | `-` | `send:WakeUp` | `-` | `send:HeartbeatResponse` | `send:Forward held` | `send:Forward held` | `err:NotLeader` | `ok:ReadReady` | `held` | `send:Forward held` | `send:Forward held` | `err:CannotCampaign(NotVoter)` | `ok:Status` | `-` | `-` | `compact` | `-` | `-` | `-` | `-` | `-` |
//! | removed | `-` | `send:PreVoteRefused` | `-` | `persist send:AppendOk` | `-` | `send:HeartbeatResponse` | `-` | `save-chunk` | `-` | `-` | `-` | `send:ForwardErr:NotLeader` | `-` | `send:WakeUp` | `-` | `send:HeartbeatResponse` | `err:Removed` | `err:Removed` | `err:Removed` | `err:Removed` | `err:Removed` | `err:Removed` | `err:Removed` | `err:Removed` | `ok:Status` | `-` | `-` | `compact` | `-` | `-` | `-` | `-` | `-` |
//! | halted | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `err:Halted` | `err:Halted` | `err:Halted` | `err:Halted` | `err:Halted` | `err:Halted` | `err:Halted` | `err:Halted` | `ok:Status` | `-` | `-` | `-` | `-` | `-` | `-` | `-` | `-` |
//!
//! Notes on the `-` cells (inputs that need no action, and why that is safe):
//!
//! * `RequestVote (newer term)` on a follower, learner, removed node or
//!   leader: a node that heard from a leader within the election timeout
//!   ignores the request (its term does not change), unless it is a
//!   leadership transfer; pre-votes are refused. This is the Raft
//!   dissertation's rule against disruptive servers and holds whether or
//!   not check-quorum is on: a member that missed a configuration change
//!   would otherwise adopt the ever higher terms of a removed node and
//!   depose every new leader. The candidate's election timer retries.
//!   Without a leader (pre-candidate, candidate) the vote is decided
//!   normally.
//! * Answers (`RequestVoteResponse`, `AppendResponse`, `HeartbeatResponse`,
//!   `SnapshotChunkAck`, `SnapshotResponse`) reaching a node not waiting for
//!   them (not campaigning, not leading, or no transfer to that peer): they
//!   belong to a role the node has left; the node that is waiting resends.
//! * `Append`/`Heartbeat`/`SnapshotChunk` of the current term reaching the
//!   leader cannot happen (one leader per term) and are ignored.
//! * `TimeoutNow` is acted on only by a follower of the sender that can
//!   campaign: not while receiving a snapshot, not by a learner or removed
//!   node; the leader's transfer then times out after an election timeout.
//! * `ForwardResponse` with an id no longer pending: the request was already
//!   answered (`Timeout`); the late answer has no one to go to.
//! * Messages from an older term: appends, heartbeats and snapshot chunks
//!   are answered with this node's term so a stale leader steps down; vote
//!   requests are refused with it; answers and `TimeoutNow` of an older
//!   term are dropped (their sender has moved on); `Forward` and
//!   `ForwardResponse` are client traffic and handled whatever their term.
//! * `EntriesLoaded` with no load outstanding for that follower, term and
//!   index (in every row: no follower lags behind the memory bound there)
//!   is a stale answer: the load was superseded, or the leadership ended.
//! * `Tick` only advances timers unless one fires. `Persisted` for a seq
//!   already durable, `SnapshotChunkLoaded` for a transfer that has moved on
//!   and `SnapshotChunkSaved` for a chunk not being saved are stale
//!   completions. `PeerConnected` on a follower: a follower owes the peer
//!   nothing (a leader or candidate re-sends what it needs).
//!   `PeerDisconnected` moves the peer to probe on a leader, and is
//!   informational elsewhere.
//! * A follower receiving a snapshot does not campaign (its log is being
//!   replaced); if no chunk arrives for four election timeouts it abandons
//!   the transfer (and tells the leader `Rejected`).
//! * Misrouted messages (another group or node) are ignored: the runtime
//!   routes by (group, to).
//! * The quiescent rows (`wake` = the node leaves the sub-state, `quiesce`
//!   = it enters it). On a quiescent follower, the notice again changes
//!   nothing, and `Tick`, `Persisted`, the snapshot completions and
//!   `PeerConnected` need no timer and do not wake (nothing waits on a
//!   quiescent node); a `wake` without `send:WakeUp` is a message of its own
//!   leader, which is awake then. The heartbeat column's commit index is
//!   the follower's own: nothing new, answered without waking (the append
//!   column brings an entry and wakes). On a quiescent leader, a notice of
//!   its own term cannot come (one leader per term), `PeerDisconnected`
//!   only moves the peer to probe (the followers that lost it wake by their
//!   own report), and the success and heartbeat answers of a caught-up
//!   member are late answers that need nothing: dropped.
//! * `Quiesce` on a node with quiescence off (every row but the quiescent
//!   ones), or that does not match: answered with `WakeUp`, so the leader
//!   keeps its heartbeats going. `WakeUp` reaching a node that does not
//!   lead: the follower that sent it runs its own timer.
//! * Vote requests (pre-vote or not) from a node that is not a voter in the
//!   configuration in force nor in the newest one in this node's log, and
//!   whose log is no newer than this node's, are ignored and do not raise
//!   the term: a removed member that never learned of its removal must not
//!   depose a healthy leader over and over (which it would when pre-vote
//!   and check-quorum are off). A candidate whose log is ahead is heard
//!   normally: it may be a voter of a configuration this node has not seen
//!   yet (a lagging or joining node), and its election may need this vote.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The `bytes` crate the engine's types use ([`bytes::Bytes`] in commands,
/// snapshot chunks and messages), so that an embedder names
/// `ferry_raft::bytes::Bytes` and never mixes two versions of it.
pub use bytes;

mod client;
mod election;
pub mod fault;
mod follower;
pub mod io;
mod leader;
pub mod log;
pub mod membership;
pub mod message;
pub mod node;
pub mod options;
pub mod progress;
mod quiesce;
pub mod quorum;
pub mod request;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod types;

pub use client::PROMOTE_LAG_ENTRIES_MAX;
pub use fault::{Fault, INDEX_MAX, TERM_MAX};
pub use io::{Action, Input, PersistRequest};
pub use membership::{Configuration, MembershipChange};
pub use message::{AppendResult, Message, MessageBody, SnapshotOutcome, COMMIT_NOTICE_READ_SEQ};
pub use node::{InitError, RaftNode};
pub use options::Options;
pub use request::{
    CampaignOutcome, CampaignRefusal, ForwardedRequest, ReadConsistency, Request, RequestError,
    RequestId, Response, Role, Status,
};
pub use types::{
    Entry, EntryPayload, GroupId, HardState, Index, LogOutline, NodeId, RestoredState,
    SnapshotMeta, Term,
};
