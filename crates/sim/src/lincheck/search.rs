//! The Wing–Gong–Lowe search over one key's operations.
//!
//! Required operations (those that completed `Ok`) have an invocation and a
//! completion event; optional ones (unknown outcome) only an invocation.
//! The events are kept in time order in two lists, one per kind. From a
//! state, an operation is a *candidate* when its invocation comes before the
//! first remaining completion: nothing still unplaced had to finish before
//! it started, so it may take effect next if the register allows it.
//! Placing one removes its events and rescans from the front; reaching the
//! first completion with every candidate tried means that operation can no
//! longer be placed in time: the state is a dead end and the search undoes
//! its last placement and tries the next candidate. The search succeeds as
//! soon as every required operation is placed; optional ones may be left
//! out. Candidates are tried required ones first, then optional ones.
//!
//! Removal and re-insertion are O(1) "dancing links" on doubly linked lists
//! held in arrays, and the undo stack is an explicit `Vec`, so the depth of
//! the search never touches the call stack.
//!
//! Pruning, each rule sound because the state it skips is covered by one
//! the search does explore:
//!
//! - **Memo with subsets.** A state is (required set placed, value,
//!   optional set used up). One with the same required set and value as an
//!   explored state and a superset of its optional set is skipped: fewer
//!   unknown operations used up is never worse ([`Memo`]).
//! - **Twins.** Unknown operations with the same effect are interchangeable
//!   once both are invoked, so only the earliest unused one is tried.
//! - **No write after an unknown operation.** Its effect would be erased at
//!   once; placing the write directly reaches the same state with the
//!   unknown operation still unused ([`Effect::is_write`]).
//!
//! Unknown outcomes can still make the exact search exponential, so
//! [`check_key`] runs up to three searches: a *relaxed* one, where unknown
//! operations may take effect any number of times (polynomial, and its "no"
//! is final); then an *eager* exact one, which finds linearizations fast;
//! and if that runs out of its share of the budget, a *layered* exact one,
//! which explores states by how many unknown operations they used and so
//! refutes far faster ([`Mode`]).

use std::collections::HashMap;
use std::fmt;

use super::{CheckOptions, UndecidedReason};
use crate::history::{OpKind, Operation, Outcome};

/// Why one key's sub-history is not linearizable, in terms a person can
/// follow: the furthest the search got, and the operation it could not
/// place after that.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The key whose sub-history is not linearizable.
    pub key: u64,
    /// The longest sequence of this key's operations that the search could
    /// put in a legal order consistent with real time (a partial
    /// linearization), in that order. When the violation was found by the
    /// relaxed search (see [`crate::lincheck`]), an unknown-outcome
    /// operation may appear more than once.
    pub linearized: Vec<Operation>,
    /// The register's value after `linearized`.
    pub value_after: Option<u64>,
    /// An operation that had already completed at that point, so it had to
    /// take effect next, but could not: no legal order places it there.
    pub blocked: Operation,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "key {}: after the longest legal ordering found ({} operations, register = {}), \
             operation {} could not take effect before its completion",
            self.key,
            self.linearized.len(),
            describe_value(self.value_after),
            describe(&self.blocked),
        )
    }
}

/// The result of checking one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyResult {
    /// A linearization exists.
    Linearizable,
    /// None exists.
    NotLinearizable(Box<Violation>),
    /// A bound was hit first.
    Undecided(UndecidedReason),
}

/// Formats an operation for a person: client, action, outcome and interval.
pub fn describe(operation: &Operation) -> String {
    let action = match operation.kind {
        OpKind::Read => "read".to_string(),
        OpKind::Write(value) => format!("write {value}"),
        OpKind::Cas { from, to } => format!("cas {from}->{to}"),
    };
    let outcome = match (operation.outcome, operation.kind) {
        (Outcome::Ok { read }, OpKind::Read) => format!("ok {}", describe_value(read)),
        (Outcome::Ok { .. }, OpKind::Write(_) | OpKind::Cas { .. }) => "ok".to_string(),
        (Outcome::Fail, _) => "fail".to_string(),
        (Outcome::Unknown, _) => "unknown".to_string(),
    };
    let completed = match operation.completed_at {
        Some(at) => format!("completed at {at}"),
        None => "no completion".to_string(),
    };
    format!(
        "client {} {action} => {outcome} (invoked at {}, {completed})",
        operation.client, operation.invoked_at
    )
}

fn describe_value(value: Option<u64>) -> String {
    match value {
        Some(value) => value.to_string(),
        None => "nil".to_string(),
    }
}

/// What an operation does to the register, reduced to what the search needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Effect {
    /// A read that returned this value.
    Read(Option<u64>),
    /// An unconditional write.
    Write(u64),
    /// A compare-and-set that succeeded (or may have).
    Cas { from: u64, to: u64 },
}

impl Effect {
    /// Whether this is an unconditional write. Placing one right after an
    /// optional operation is never needed: the write erases the optional
    /// operation's effect, so the same state, with the optional operation
    /// still unused, is reached by placing the write directly, which the
    /// search also tries (the write is a candidate there too, since an
    /// optional operation has no completion to block it).
    fn is_write(self) -> bool {
        match self {
            Effect::Write(_) => true,
            Effect::Read(_) | Effect::Cas { .. } => false,
        }
    }

    /// The register's value after this operation takes effect on `value`, or
    /// `None` when it cannot take effect there. An unknown CAS whose compare
    /// would fail is the same as the CAS never taking effect, which the
    /// search already covers by leaving it out, so it is refused here too.
    fn apply(self, value: Option<u64>) -> Option<Option<u64>> {
        match self {
            Effect::Read(read) => (read == value).then_some(value),
            Effect::Write(written) => Some(Some(written)),
            Effect::Cas { from, to } => (value == Some(from)).then_some(Some(to)),
        }
    }
}

/// Marks "no node" in the event list's links.
const NIL: u32 = u32::MAX;
/// The list's head sentinel; events are nodes 1..=events.
const HEAD: u32 = 0;

/// The event list: node `n` is either operation `op_of[n]`'s invocation or
/// its completion. Links are `u32` to keep the arrays compact; the number
/// of events is checked against that range.
struct EventList {
    next: Vec<u32>,
    prev: Vec<u32>,
    op_of: Vec<u32>,
    is_invocation: Vec<bool>,
    /// Per operation: its invocation node.
    invocation_node: Vec<u32>,
    /// Per operation: its completion node, `NIL` when it has none.
    completion_node: Vec<u32>,
}

impl EventList {
    /// Orders events by time; at equal times invocations come first, so two
    /// operations that touch at one instant count as concurrent (the
    /// permissive reading: the checker never blames an order that a shared
    /// timestamp cannot establish).
    fn new(operations: &[Operation], is_member: impl Fn(&Operation) -> bool) -> EventList {
        // (time, completion?, operation); a missing completion is at
        // +infinity, which no event needs because it has no node.
        let mut events: Vec<(u64, bool, u32)> = Vec::with_capacity(operations.len() * 2);
        for (index, operation) in operations.iter().enumerate() {
            if !is_member(operation) {
                continue;
            }
            let index = index as u32;
            events.push((operation.invoked_at, false, index));
            if must_take_effect(operation) {
                events.push((completion_time(operation), true, index));
            }
        }
        events.sort_unstable();

        let nodes = events.len() + 1;
        let mut list = EventList {
            next: vec![NIL; nodes],
            prev: vec![NIL; nodes],
            op_of: vec![NIL; nodes],
            is_invocation: vec![false; nodes],
            invocation_node: vec![NIL; operations.len()],
            completion_node: vec![NIL; operations.len()],
        };
        for (position, (_, is_completion, op)) in events.iter().enumerate() {
            let node = position as u32 + 1;
            list.prev[node as usize] = node - 1;
            list.next[node as usize - 1] = node;
            list.op_of[node as usize] = *op;
            list.is_invocation[node as usize] = !is_completion;
            if *is_completion {
                list.completion_node[*op as usize] = node;
            } else {
                list.invocation_node[*op as usize] = node;
            }
        }
        list
    }

    /// Relinks the list to hold exactly the events of operations for which
    /// `is_present` holds, in time order (node numbers are time order).
    fn rebuild(&mut self, is_present: impl Fn(u32) -> bool) {
        let mut last = HEAD;
        for node in 1..self.op_of.len() as u32 {
            if is_present(self.op_of[node as usize]) {
                self.next[last as usize] = node;
                self.prev[node as usize] = last;
                last = node;
            }
        }
        self.next[last as usize] = NIL;
    }

    fn unlink(&mut self, node: u32) {
        let (prev, next) = (self.prev[node as usize], self.next[node as usize]);
        self.next[prev as usize] = next;
        if next != NIL {
            self.prev[next as usize] = prev;
        }
    }

    /// Undoes `unlink(node)`; valid because undo happens in exactly the
    /// reverse order of removal (the search is a stack), so the node's own
    /// links still name its old neighbours.
    fn relink(&mut self, node: u32) {
        let (prev, next) = (self.prev[node as usize], self.next[node as usize]);
        self.next[prev as usize] = node;
        if next != NIL {
            self.prev[next as usize] = node;
        }
    }

    fn remove_operation(&mut self, op: u32) {
        self.unlink(self.invocation_node[op as usize]);
        let completion = self.completion_node[op as usize];
        if completion != NIL {
            self.unlink(completion);
        }
    }

    fn restore_operation(&mut self, op: u32) {
        let completion = self.completion_node[op as usize];
        if completion != NIL {
            self.relink(completion);
        }
        self.relink(self.invocation_node[op as usize]);
    }
}

/// When a required operation completed; one that completed without the
/// client seeing it (no time recorded) completes at +infinity.
fn completion_time(operation: &Operation) -> u64 {
    operation.completed_at.unwrap_or(u64::MAX)
}

/// Whether the operation must appear in every linearization: it completed
/// and the client was told it took effect.
fn must_take_effect(operation: &Operation) -> bool {
    match operation.outcome {
        Outcome::Ok { .. } => true,
        Outcome::Unknown | Outcome::Fail => false,
    }
}

/// What the operation may do to the register, or `None` when it cannot
/// matter: a failed operation had no effect, and a read whose result is
/// unknown observed nothing.
fn effect_of(operation: &Operation) -> Option<Effect> {
    match (operation.kind, operation.outcome) {
        (_, Outcome::Fail) => None,
        (OpKind::Read, Outcome::Unknown) => None,
        (OpKind::Read, Outcome::Ok { read }) => Some(Effect::Read(read)),
        (OpKind::Write(value), Outcome::Ok { .. } | Outcome::Unknown) => Some(Effect::Write(value)),
        (OpKind::Cas { from, to }, Outcome::Ok { .. } | Outcome::Unknown) => {
            Some(Effect::Cas { from, to })
        }
    }
}

/// A fixed-size set of small indexes, as words.
struct BitSet {
    words: Vec<u64>,
}

impl BitSet {
    fn new(bits: usize) -> BitSet {
        BitSet {
            words: vec![0; bits.div_ceil(64)],
        }
    }
    fn insert(&mut self, bit: u32) {
        self.words[bit as usize / 64] |= 1 << (bit % 64);
    }
    fn remove(&mut self, bit: u32) {
        self.words[bit as usize / 64] &= !(1 << (bit % 64));
    }
    fn contains(&self, bit: u32) -> bool {
        self.words[bit as usize / 64] & (1 << (bit % 64)) != 0
    }
    fn clear(&mut self) {
        self.words.fill(0);
    }
}

/// Whether every bit of `small` is in `large` (same length).
fn is_subset(small: &[u64], large: &[u64]) -> bool {
    small.iter().zip(large).all(|(s, l)| s & !l == 0)
}

/// Where an operation sits in the placed-sets: required operations (which
/// must all be placed) and optional ones (unknown outcome) are numbered
/// separately, because the memo treats the two sets differently.
#[derive(Clone, Copy, Debug)]
enum Slot {
    Required(u32),
    Optional(u32),
}

/// The placed operations, split as [`Slot`] says.
struct Placed {
    required: BitSet,
    optional: BitSet,
}

impl Placed {
    fn insert(&mut self, slot: Slot) {
        match slot {
            Slot::Required(bit) => self.required.insert(bit),
            Slot::Optional(bit) => self.optional.insert(bit),
        }
    }
    fn remove(&mut self, slot: Slot) {
        match slot {
            Slot::Required(bit) => self.required.remove(bit),
            Slot::Optional(bit) => self.optional.remove(bit),
        }
    }
    fn contains(&self, slot: Slot) -> bool {
        match slot {
            Slot::Required(bit) => self.required.contains(bit),
            Slot::Optional(bit) => self.optional.contains(bit),
        }
    }
}

/// The memo of explored search states.
///
/// A state is (required operations placed, register value, optional
/// operations placed). Two states with the same required set and value
/// differ only in which optional operations are used up, and having used
/// up fewer is never worse: any way to finish from the state with more can
/// be replayed from the one with fewer, leaving the extra ones out (they
/// have no completion, so they constrain nothing). So a state is skipped
/// when a state with the same required set and value and a *subset* of its
/// optional operations was already visited: that one either failed, or is
/// an ancestor that explores every continuation this one could. Without
/// this, histories with many unknown outcomes blow up: each unknown write
/// could be placed at almost any point, and every subset of them would be
/// a new state.
///
/// The key (required set plus value) is flattened into one slice so that a
/// lookup needs no allocation (`Box<[u64]>` borrows as `[u64]`); each key
/// keeps its optional sets as an antichain (no set contains another).
struct Memo {
    seen: HashMap<Box<[u64]>, Vec<Box<[u64]>>>,
    scratch: Vec<u64>,
    /// States recorded so far, superseded ones included: this also bounds
    /// the [`PathTree`] and the seeds, which grow with it.
    recorded: usize,
    recorded_max: usize,
}

enum MemoAnswer {
    New,
    Seen,
    Full,
}

impl Memo {
    fn new(entries_max: usize) -> Memo {
        Memo {
            seen: HashMap::new(),
            scratch: Vec::new(),
            recorded: 0,
            recorded_max: entries_max,
        }
    }

    /// Loads the key (required set and value) into `scratch`.
    fn load_key(&mut self, placed: &Placed, value: Option<u64>) {
        self.scratch.clear();
        self.scratch.extend_from_slice(&placed.required.words);
        match value {
            Some(value) => self.scratch.extend_from_slice(&[1, value]),
            None => self.scratch.extend_from_slice(&[0, 0]),
        }
    }

    /// Records the state unless it is covered by one already recorded.
    fn insert(&mut self, placed: &Placed, value: Option<u64>) -> MemoAnswer {
        self.load_key(placed, value);
        let optional = placed.optional.words.as_slice();
        let sets = self.seen.get_mut(self.scratch.as_slice());
        if let Some(sets) = &sets {
            if sets.iter().any(|seen| is_subset(seen, optional)) {
                return MemoAnswer::Seen;
            }
        }
        if self.recorded >= self.recorded_max {
            return MemoAnswer::Full;
        }
        self.recorded += 1;
        match sets {
            Some(sets) => {
                // Keep an antichain: drop the sets this one covers.
                sets.retain(|seen| !is_subset(optional, seen));
                sets.push(optional.into());
            }
            None => {
                self.seen.insert(
                    self.scratch.clone().into_boxed_slice(),
                    vec![optional.into()],
                );
            }
        }
        MemoAnswer::New
    }

    /// Whether this exact state is still recorded, i.e. was not superseded
    /// by a state with the same required set and value and fewer optional
    /// operations used.
    fn is_current(&mut self, placed: &Placed, value: Option<u64>) -> bool {
        self.load_key(placed, value);
        let optional = placed.optional.words.as_slice();
        self.seen
            .get(self.scratch.as_slice())
            .is_some_and(|sets| sets.iter().any(|seen| **seen == *optional))
    }
}

/// Where the scan for the next candidate stands. Each state is scanned in
/// two phases: first the required operations invoked before the first
/// remaining completion, then the optional ones invoked by that time.
/// Trying required operations first makes the search reach states with few
/// optional operations used before those with many, so the memo's subset
/// rule ([`Memo`]) prunes the latter instead of the other way round.
#[derive(Clone, Copy, Debug)]
enum Cursor {
    /// At this node of the required operations' event list.
    Required(u32),
    /// At this node of the optional operations' list; `first_completion`
    /// is the first completion left in the required list.
    Optional { node: u32, first_completion: u32 },
}

/// One placement on the undo stack.
struct Placement {
    op: u32,
    value_before: Option<u64>,
    /// Its node in the [`PathTree`].
    path: u32,
}

/// Decides whether `operations` (all on `key`) have a linearization, within
/// the bounds of `options`.
///
/// When some outcomes are unknown, a cheap relaxed search runs first, in
/// which an unknown operation may take effect any number of times instead
/// of at most once. Every real linearization is also a relaxed one, so if
/// none exists the history is certainly not linearizable; and the relaxed
/// search's states are only (required operations placed, value), so it
/// stays fast where the exact search, which must also track which unknown
/// operations are used up, can blow up. Only if the relaxed search finds an
/// order does the exact search run: eagerly first, with a quarter of the
/// remaining budget, then layered with the rest ([`Mode`]). All of them
/// draw on the one per-key step budget.
pub(super) fn check_key(key: u64, operations: &[Operation], options: CheckOptions) -> KeyResult {
    let reduced = reduce_unknowns(operations);
    let (relevant, effects) = relevant_operations(&reduced);
    if relevant.len() >= (u32::MAX / 2) as usize {
        // Two events per operation must fit the u32 links. Two billion
        // operations on one key is far past any search budget anyway.
        return KeyResult::Undecided(UndecidedReason::TooManyOperations {
            operations: relevant.len(),
        });
    }
    let model = KeyModel::new(key, &relevant, effects);
    let optional_count = model.optional_count;
    let mut steps_left = options.steps_per_key_max;
    if optional_count == 0 {
        // All three modes are the same search then.
        return search(&model, Mode::Eager, &mut steps_left, options);
    }
    match search(&model, Mode::Relaxed, &mut steps_left, options) {
        KeyResult::Linearizable => {}
        decided_no_or_undecided @ (KeyResult::NotLinearizable(_) | KeyResult::Undecided(_)) => {
            return decided_no_or_undecided
        }
    }
    // A quarter of what is left for the eager search, which settles most
    // histories quickly; the layered search gets the rest.
    let eager_budget = steps_left / 4;
    let mut eager_left = eager_budget;
    let eager = search(&model, Mode::Eager, &mut eager_left, options);
    steps_left -= eager_budget - eager_left;
    match eager {
        KeyResult::Undecided(_) => search(&model, Mode::Layered, &mut steps_left, options),
        decided @ (KeyResult::Linearizable | KeyResult::NotLinearizable(_)) => decided,
    }
}

/// Runs the search in one mode only, for tests that hold each mode to a
/// brute-force oracle.
#[cfg(test)]
pub(super) fn check_key_in_mode(key: u64, operations: &[Operation], mode: Mode) -> KeyResult {
    let (relevant, effects) = relevant_operations(operations);
    let model = KeyModel::new(key, &relevant, effects);
    let options = CheckOptions::default();
    let mut steps_left = options.steps_per_key_max;
    search(&model, mode, &mut steps_left, options)
}

/// Two exact reductions of unknown-outcome operations, applied before the
/// search; each keeps the verdict, and together they remove most of what
/// makes the exact search exponential (in the simulator's histories nine in
/// ten unknown writes are never read).
///
/// A value is *observed* by a read that returned it (with an `Ok` outcome)
/// or by a CAS that compares against it (`Ok` or unknown).
///
/// 1. **An unknown write of a value nobody observes is left out.** In any
///    linearization that places it, the operations after it until the next
///    write would see its value; none can (no read returned it, no CAS
///    compares with it), so the next effective operation is a blind write,
///    or nothing: removing it leaves the order legal. And an unknown
///    operation may always be left out. (Unknown CAS likewise, by the value
///    it writes.) Repeated until nothing changes, since a removed CAS may
///    have been the only observer of another value.
/// 2. **An unknown write of a value that only it writes, and that a
///    completed operation observed, took effect, before the earliest such
///    observer completed.** The observer's value can only come from it. So
///    it becomes a required operation completing then (only when that is
///    not before its invocation; otherwise the history is refuted by the
///    search as before). In a reported violation such an operation shows as
///    completed at that instant.
fn reduce_unknowns(operations: &[Operation]) -> Vec<Operation> {
    let produced = |operation: &Operation| match operation.kind {
        OpKind::Write(value) | OpKind::Cas { to: value, .. } => Some(value),
        OpKind::Read => None,
    };
    let mut kept: Vec<Operation> = operations
        .iter()
        .filter(|o| effect_of(o).is_some())
        .copied()
        .collect();
    loop {
        let mut observed = std::collections::HashSet::new();
        for o in &kept {
            match (o.kind, o.outcome) {
                (OpKind::Read, Outcome::Ok { read: Some(value) }) => {
                    observed.insert(value);
                }
                (OpKind::Cas { from, .. }, Outcome::Ok { .. } | Outcome::Unknown) => {
                    observed.insert(from);
                }
                (OpKind::Read | OpKind::Write(_) | OpKind::Cas { .. }, _) => {}
            }
        }
        let before = kept.len();
        kept.retain(|o| {
            o.outcome != Outcome::Unknown || produced(o).is_none_or(|v| observed.contains(&v))
        });
        if kept.len() == before {
            break;
        }
    }
    let mut producers: HashMap<u64, u32> = HashMap::new();
    // The earliest completion of a completed operation observing a value.
    let mut first_seen: HashMap<u64, u64> = HashMap::new();
    for o in &kept {
        if let Some(value) = produced(o) {
            *producers.entry(value).or_default() += 1;
        }
        let seen = match (o.kind, o.outcome) {
            (OpKind::Read, Outcome::Ok { read: Some(value) }) => Some(value),
            (OpKind::Cas { from, .. }, Outcome::Ok { .. }) => Some(from),
            (OpKind::Read | OpKind::Write(_) | OpKind::Cas { .. }, _) => None,
        };
        if let (Some(value), Some(at)) = (seen, o.completed_at) {
            let earliest = first_seen.entry(value).or_insert(at);
            *earliest = (*earliest).min(at);
        }
    }
    for o in &mut kept {
        if o.outcome != Outcome::Unknown {
            continue;
        }
        let Some(value) = produced(o) else { continue };
        if producers.get(&value) != Some(&1) {
            continue;
        }
        if let Some(&at) = first_seen.get(&value) {
            if at >= o.invoked_at {
                o.outcome = Outcome::Ok { read: None };
                o.completed_at = Some(at);
            }
        }
    }
    kept
}

/// The operations that can matter (see [`effect_of`]) and their effects.
fn relevant_operations(operations: &[Operation]) -> (Vec<Operation>, Vec<Effect>) {
    let mut effects: Vec<Effect> = Vec::with_capacity(operations.len());
    let mut relevant: Vec<Operation> = Vec::with_capacity(operations.len());
    for operation in operations {
        if let Some(effect) = effect_of(operation) {
            effects.push(effect);
            relevant.push(*operation);
        }
    }
    (relevant, effects)
}

impl<'a> KeyModel<'a> {
    fn new(key: u64, operations: &'a [Operation], effects: Vec<Effect>) -> KeyModel<'a> {
        let mut slots = Vec::with_capacity(operations.len());
        let (mut required_count, mut optional_count) = (0u32, 0u32);
        for operation in operations {
            if must_take_effect(operation) {
                slots.push(Slot::Required(required_count));
                required_count += 1;
            } else {
                slots.push(Slot::Optional(optional_count));
                optional_count += 1;
            }
        }
        let twins = earlier_twins(operations, &effects, &slots);
        KeyModel {
            key,
            operations,
            effects,
            slots,
            twins,
            required_count,
            optional_count,
        }
    }
}

/// One key's operations, prepared for searching.
struct KeyModel<'a> {
    key: u64,
    /// The operations that matter (failed ones and unknown reads removed).
    operations: &'a [Operation],
    /// Per operation: what it does to the register.
    effects: Vec<Effect>,
    /// Per operation: its place in the placed-sets.
    slots: Vec<Slot>,
    /// Per operation: its earlier twin (see [`earlier_twins`]), or `NIL`.
    twins: Vec<u32>,
    required_count: u32,
    optional_count: u32,
}

/// How the search treats optional (unknown-outcome) operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Each may take effect any number of times: an over-approximation
    /// whose "no" is a real "no" (see [`check_key`]).
    Relaxed,
    /// Each takes effect at most once (the real semantics), and the search
    /// places one as soon as it fits, depth first. Quick to find a
    /// linearization, but a refutation can drown in the ways to combine
    /// unknown operations.
    Eager,
    /// The real semantics, explored in layers by how many optional
    /// operations are used: every state using `j` is explored before any
    /// using `j + 1`, so the memo's subset rule prunes as much as it can.
    /// Slower to find a linearization that needs many unknown operations,
    /// far faster to refute one.
    Layered,
}

/// The Wing–Gong–Lowe search proper, in the given mode, spending steps from
/// `steps_left`.
fn search(model: &KeyModel, mode: Mode, steps_left: &mut u64, options: CheckOptions) -> KeyResult {
    let KeyModel {
        key,
        operations,
        ref effects,
        ref slots,
        ref twins,
        required_count,
        optional_count,
    } = *model;
    let mut required_events = EventList::new(operations, must_take_effect);
    let mut optional_events = EventList::new(operations, |op| !must_take_effect(op));
    let mut placed = Placed {
        required: BitSet::new(required_count as usize),
        optional: BitSet::new(optional_count as usize),
    };
    let mut memo = Memo::new(options.cache_entries_max);
    let cache_full = KeyResult::Undecided(UndecidedReason::CacheFull {
        cache_entries_max: options.cache_entries_max,
    });
    match memo.insert(&placed, None) {
        MemoAnswer::New => {}
        MemoAnswer::Seen | MemoAnswer::Full => return cache_full,
    }
    // Every path the search takes, as a tree of placements; one node per
    // memoized state, so the memo's bound bounds it too.
    let mut paths = PathTree::default();
    // Seeds by layer: layer `j` holds states that used `j` optional
    // operations (only the layered mode makes any beyond the root).
    let mut layers: Vec<Vec<Seed>> = vec![vec![Seed {
        path: NIL,
        value: None,
        after_optional: false,
    }]];
    let mut layer = 0;
    let mut stack: Vec<Placement> = Vec::with_capacity(operations.len());
    // The deepest point reached, for the explanation: (depth, path, value,
    // the operation whose completion stopped the search there).
    let mut deepest: Option<(usize, u32, Option<u64>, u32)> = None;
    // Rebuilding the lists for a seed costs a pass over every event; it is
    // charged as one step per this many events.
    const EVENTS_PER_STEP: usize = 16;
    let rebuild_steps = (required_events.op_of.len() + optional_events.op_of.len())
        .div_ceil(EVENTS_PER_STEP) as u64;

    loop {
        // Take the next seed: the lowest layer first, so that states using
        // fewer optional operations are explored before those using more
        // and the memo's subset rule prunes the latter.
        let Some(seed) = layers.get_mut(layer).and_then(Vec::pop) else {
            if layer + 1 < layers.len() {
                layer += 1;
                continue;
            }
            // Every seed's search ends at a dead end (success returns at
            // once), and the root seed is never superseded, so one was met.
            let Some((_, path, value_after, blocked)) = deepest else {
                unreachable!("the search ended without meeting a dead end");
            };
            return KeyResult::NotLinearizable(Box::new(Violation {
                key,
                linearized: paths
                    .ops_to(path)
                    .iter()
                    .map(|&index| operations[index as usize])
                    .collect(),
                value_after,
                blocked: operations[blocked as usize],
            }));
        };
        if *steps_left < rebuild_steps {
            return KeyResult::Undecided(UndecidedReason::StepsExhausted {
                steps_per_key_max: options.steps_per_key_max,
            });
        }
        *steps_left -= rebuild_steps;

        // Restore the seed's state from its path.
        placed.required.clear();
        placed.optional.clear();
        let seed_ops = paths.ops_to(seed.path);
        for &op in &seed_ops {
            placed.insert(slots[op as usize]);
        }
        if !memo.is_current(&placed, seed.value) {
            // A state with fewer optional operations used superseded it.
            continue;
        }
        let mut unplaced_required = required_count
            - seed_ops
                .iter()
                .filter(|&&op| matches!(slots[op as usize], Slot::Required(_)))
                .count() as u32;
        required_events.rebuild(|op| !placed.contains(slots[op as usize]));
        optional_events.rebuild(|op| !placed.contains(slots[op as usize]));
        let mut value = seed.value;
        let seed_depth = seed_ops.len();
        stack.clear();
        let mut cursor = Cursor::Required(required_events.next[HEAD as usize]);

        // Depth-first search from the seed.
        loop {
            if unplaced_required == 0 {
                return KeyResult::Linearizable;
            }
            if *steps_left == 0 {
                return KeyResult::Undecided(UndecidedReason::StepsExhausted {
                    steps_per_key_max: options.steps_per_key_max,
                });
            }
            *steps_left -= 1;
            let path_here = stack.last().map_or(seed.path, |placement| placement.path);

            // The next candidate, or at a dead end the first remaining
            // completion: its operation is unplaced and every candidate
            // before it has been tried.
            let candidate: Result<u32, u32> = match cursor {
                Cursor::Required(node) => {
                    // A required operation is unplaced, so its completion
                    // is still ahead in the list: the scan stops there.
                    assert!(node != NIL, "scan ran past every remaining completion");
                    if required_events.is_invocation[node as usize] {
                        Ok(required_events.op_of[node as usize])
                    } else {
                        // Phase 2: optional operations invoked by then.
                        cursor = Cursor::Optional {
                            node: optional_events.next[HEAD as usize],
                            first_completion: node,
                        };
                        continue;
                    }
                }
                Cursor::Optional {
                    node,
                    first_completion,
                } => {
                    let deadline = completion_time(
                        &operations[required_events.op_of[first_completion as usize] as usize],
                    );
                    optional_events
                        .op_of
                        .get(node as usize)
                        .copied()
                        .filter(|&op| operations[op as usize].invoked_at <= deadline)
                        .ok_or(first_completion)
                }
            };

            let op = match candidate {
                Ok(op) => op,
                Err(first_completion) => {
                    let blocked = required_events.op_of[first_completion as usize];
                    let depth = seed_depth + stack.len();
                    if deepest.is_none_or(|(best, ..)| depth > best) {
                        deepest = Some((depth, path_here, value, blocked));
                    }
                    let Some(undo) = stack.pop() else {
                        // Back at the seed: every way on from it failed.
                        break;
                    };
                    let slot = slots[undo.op as usize];
                    value = undo.value_before;
                    cursor = match slot {
                        Slot::Required(_) => {
                            placed.remove(slot);
                            required_events.restore_operation(undo.op);
                            unplaced_required += 1;
                            Cursor::Required(
                                required_events.next
                                    [required_events.invocation_node[undo.op as usize] as usize],
                            )
                        }
                        // The required events are as they were at the dead
                        // end, so its first completion is the parent state's
                        // too.
                        Slot::Optional(_) => {
                            match mode {
                                Mode::Eager | Mode::Layered => {
                                    placed.remove(slot);
                                    optional_events.restore_operation(undo.op);
                                }
                                // Never used up, so nothing to restore.
                                Mode::Relaxed => {}
                            }
                            Cursor::Optional {
                                node: optional_events.next
                                    [optional_events.invocation_node[undo.op as usize] as usize],
                                first_completion,
                            }
                        }
                    };
                    continue;
                }
            };

            let slot = slots[op as usize];
            let effect = effects[op as usize];
            let after_optional = match stack.last() {
                Some(placement) => matches!(slots[placement.op as usize], Slot::Optional(_)),
                None => seed.after_optional,
            };
            let value_after = effect.apply(value);
            let worth_trying = value_after.is_some()
                && !(after_optional && effect.is_write())
                && !has_unplaced_twin(op, twins, slots, &placed);
            if let (true, Some(value_after)) = (worth_trying, value_after) {
                match (slot, mode) {
                    (Slot::Required(_), _) => {
                        placed.insert(slot);
                        match memo.insert(&placed, value_after) {
                            MemoAnswer::New => {
                                let path = paths.push(op, path_here);
                                stack.push(Placement {
                                    op,
                                    value_before: value,
                                    path,
                                });
                                value = value_after;
                                required_events.remove_operation(op);
                                unplaced_required -= 1;
                                cursor = Cursor::Required(required_events.next[HEAD as usize]);
                                continue;
                            }
                            MemoAnswer::Seen => placed.remove(slot),
                            MemoAnswer::Full => return cache_full,
                        }
                    }
                    (Slot::Optional(_), Mode::Eager) => {
                        placed.insert(slot);
                        match memo.insert(&placed, value_after) {
                            MemoAnswer::New => {
                                let path = paths.push(op, path_here);
                                stack.push(Placement {
                                    op,
                                    value_before: value,
                                    path,
                                });
                                value = value_after;
                                optional_events.remove_operation(op);
                                cursor = Cursor::Required(required_events.next[HEAD as usize]);
                                continue;
                            }
                            MemoAnswer::Seen => placed.remove(slot),
                            MemoAnswer::Full => return cache_full,
                        }
                    }
                    // Using up an optional operation starts a state of the
                    // next layer, explored after this one.
                    (Slot::Optional(_), Mode::Layered) => {
                        placed.insert(slot);
                        let answer = memo.insert(&placed, value_after);
                        placed.remove(slot);
                        match answer {
                            MemoAnswer::New => {
                                let next_layer = layer + 1;
                                if layers.len() <= next_layer {
                                    layers.push(Vec::new());
                                }
                                layers[next_layer].push(Seed {
                                    path: paths.push(op, path_here),
                                    value: value_after,
                                    after_optional: true,
                                });
                            }
                            MemoAnswer::Seen => {}
                            MemoAnswer::Full => return cache_full,
                        }
                    }
                    // Relaxed mode: the optional operation takes effect but
                    // is not used up (it stays listed and unplaced).
                    (Slot::Optional(_), Mode::Relaxed) => match memo.insert(&placed, value_after) {
                        MemoAnswer::New => {
                            let path = paths.push(op, path_here);
                            stack.push(Placement {
                                op,
                                value_before: value,
                                path,
                            });
                            value = value_after;
                            cursor = Cursor::Required(required_events.next[HEAD as usize]);
                            continue;
                        }
                        MemoAnswer::Seen => {}
                        MemoAnswer::Full => return cache_full,
                    },
                }
            }
            cursor = match cursor {
                Cursor::Required(node) => Cursor::Required(required_events.next[node as usize]),
                Cursor::Optional {
                    node,
                    first_completion,
                } => Cursor::Optional {
                    node: optional_events.next[node as usize],
                    first_completion,
                },
            };
        }
    }
}

/// A state the exact search has reached but not yet explored from.
struct Seed {
    /// The placements that lead to it, in the [`PathTree`].
    path: u32,
    /// The register's value there.
    value: Option<u64>,
    /// Whether the last placement was an optional operation (see
    /// [`Effect::is_write`]'s use: a write right after one is pointless).
    after_optional: bool,
}

/// Every placement sequence the search has made, as a tree stored in an
/// array: node `n` placed operation `op[n]` after the path ending at
/// `parent[n]` (`NIL`: the empty path). Seeds and the explanation name a
/// path by its last node.
#[derive(Default)]
struct PathTree {
    op: Vec<u32>,
    parent: Vec<u32>,
}

impl PathTree {
    fn push(&mut self, op: u32, parent: u32) -> u32 {
        let node = self.op.len() as u32;
        self.op.push(op);
        self.parent.push(parent);
        node
    }

    /// The operations on the path ending at `node`, first to last.
    fn ops_to(&self, mut node: u32) -> Vec<u32> {
        let mut ops = Vec::new();
        while node != NIL {
            ops.push(self.op[node as usize]);
            node = self.parent[node as usize];
        }
        ops.reverse();
        ops
    }
}

/// For each optional operation, the nearest optional operation with the
/// same effect that comes before it in the event list (invoked earlier), if
/// any. Such twins are interchangeable once both are invoked, so the search
/// only ever places the earliest unplaced one of a family
/// ([`has_unplaced_twin`]); a family is then always placed in list order,
/// which is why checking the nearest twin is enough.
fn earlier_twins(operations: &[Operation], effects: &[Effect], slots: &[Slot]) -> Vec<u32> {
    let mut optional: Vec<u32> = (0..operations.len() as u32)
        .filter(|&op| matches!(slots[op as usize], Slot::Optional(_)))
        .collect();
    // The event list's order for invocations: time, then index.
    optional.sort_by_key(|&op| (operations[op as usize].invoked_at, op));
    let mut last_of_family: HashMap<Effect, u32> = HashMap::new();
    let mut twins = vec![NIL; operations.len()];
    for op in optional {
        if let Some(twin) = last_of_family.insert(effects[op as usize], op) {
            twins[op as usize] = twin;
        }
    }
    twins
}

/// Whether an earlier twin of `op` (see [`earlier_twins`]) is still
/// unplaced, in which case placing `op` would only repeat the search that
/// placing the twin does.
fn has_unplaced_twin(op: u32, twins: &[u32], slots: &[Slot], placed: &Placed) -> bool {
    let twin = twins[op as usize];
    twin != NIL && !placed.contains(slots[twin as usize])
}
