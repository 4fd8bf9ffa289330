//! Tests of the checker on hand-made histories (one per rule), property
//! tests against histories with a known answer and against a brute-force
//! oracle, and tests of the Jepsen parser.

use proptest::prelude::*;

use super::jepsen::{parse, ParseProblem};
use super::search::{KeyResult, Mode};
use super::*;
use crate::history::{History, OpKind, Operation, Outcome};

fn op(
    client: u64,
    key: u64,
    kind: OpKind,
    interval: (u64, Option<u64>),
    outcome: Outcome,
) -> Operation {
    Operation {
        client,
        key,
        kind,
        invoked_at: interval.0,
        completed_at: interval.1,
        outcome,
    }
}

fn write(client: u64, value: u64, invoked: u64, completed: u64) -> Operation {
    op(
        client,
        0,
        OpKind::Write(value),
        (invoked, Some(completed)),
        Outcome::Ok { read: None },
    )
}

fn read(client: u64, value: Option<u64>, invoked: u64, completed: u64) -> Operation {
    op(
        client,
        0,
        OpKind::Read,
        (invoked, Some(completed)),
        Outcome::Ok { read: value },
    )
}

fn cas(client: u64, from: u64, to: u64, invoked: u64, completed: u64) -> Operation {
    op(
        client,
        0,
        OpKind::Cas { from, to },
        (invoked, Some(completed)),
        Outcome::Ok { read: None },
    )
}

fn unknown(client: u64, kind: OpKind, invoked: u64) -> Operation {
    op(client, 0, kind, (invoked, None), Outcome::Unknown)
}

fn failed(mut operation: Operation) -> Operation {
    operation.outcome = Outcome::Fail;
    operation
}

fn on_key(mut operation: Operation, key: u64) -> Operation {
    operation.key = key;
    operation
}

fn verdict(operations: &[Operation]) -> Verdict {
    check(&History {
        operations: operations.to_vec(),
    })
}

fn violation(operations: &[Operation]) -> Violation {
    match verdict(operations) {
        Verdict::NotLinearizable(violation) => *violation,
        other => panic!("expected a violation, got {other:?}"),
    }
}

#[test]
fn empty_history_is_linearizable() {
    assert_eq!(verdict(&[]), Verdict::Linearizable);
}

#[test]
fn read_of_none_before_any_write_is_linearizable() {
    assert_eq!(
        verdict(&[
            read(0, None, 0, 1),
            write(1, 5, 2, 3),
            read(0, Some(5), 4, 5)
        ]),
        Verdict::Linearizable
    );
}

#[test]
fn read_of_none_after_a_completed_write_is_a_stale_read() {
    let history = [write(1, 5, 0, 1), read(0, None, 2, 3)];
    let violation = violation(&history);
    assert_eq!(violation.key, 0);
    assert_eq!(violation.blocked, history[1]);
    assert_eq!(violation.linearized, vec![history[0]]);
    assert_eq!(violation.value_after, Some(5));
}

#[test]
fn stale_read_of_an_overwritten_value_is_not_linearizable() {
    let history = [
        write(0, 1, 0, 1),
        write(0, 2, 2, 3),
        read(1, Some(2), 4, 5),
        read(2, Some(1), 6, 7),
    ];
    let violation = violation(&history);
    assert_eq!(violation.blocked, history[3]);
}

#[test]
fn reads_concurrent_with_a_write_may_see_either_value_in_order() {
    // The write spans both reads: old then new is fine.
    assert_eq!(
        verdict(&[
            write(0, 1, 0, 10),
            read(1, None, 1, 2),
            read(2, Some(1), 3, 4)
        ]),
        Verdict::Linearizable
    );
    // New then old is not: once a reader saw 1, nobody may see nil again.
    assert!(matches!(
        verdict(&[
            write(0, 1, 0, 10),
            read(1, Some(1), 1, 2),
            read(2, None, 3, 4)
        ]),
        Verdict::NotLinearizable(_)
    ));
}

#[test]
fn concurrent_writes_may_take_effect_in_either_order() {
    let writes = [write(0, 1, 0, 10), write(1, 2, 0, 10)];
    for (first, second) in [(1, 2), (2, 1)] {
        let mut history = writes.to_vec();
        history.push(read(2, Some(first), 4, 5));
        history.push(read(2, Some(second), 6, 7));
        assert_eq!(verdict(&history), Verdict::Linearizable);
    }
    // After both writes completed, two sequential reads must agree.
    let mut history = writes.to_vec();
    history.push(read(2, Some(1), 11, 12));
    history.push(read(2, Some(2), 13, 14));
    assert!(matches!(verdict(&history), Verdict::NotLinearizable(_)));
}

#[test]
fn operations_that_touch_in_time_count_as_concurrent() {
    // The read is invoked at the write's completion instant.
    assert_eq!(
        verdict(&[write(0, 1, 0, 5), read(1, None, 5, 6)]),
        Verdict::Linearizable
    );
    assert!(matches!(
        verdict(&[write(0, 1, 0, 5), read(1, None, 6, 7)]),
        Verdict::NotLinearizable(_)
    ));
}

#[test]
fn unknown_write_may_take_effect_long_after_its_invocation() {
    assert_eq!(
        verdict(&[
            unknown(0, OpKind::Write(1), 0),
            read(1, None, 10, 11),
            read(1, None, 20, 21),
            read(1, Some(1), 100, 101),
            read(1, Some(1), 200, 201),
        ]),
        Verdict::Linearizable
    );
}

#[test]
fn unknown_write_takes_effect_at_most_once() {
    assert!(matches!(
        verdict(&[
            unknown(0, OpKind::Write(1), 0),
            read(1, Some(1), 10, 11),
            write(2, 2, 12, 13),
            read(1, Some(1), 14, 15),
        ]),
        Verdict::NotLinearizable(_)
    ));
}

#[test]
fn unknown_write_may_never_take_effect() {
    assert_eq!(
        verdict(&[
            write(2, 7, 0, 1),
            unknown(0, OpKind::Write(1), 2),
            read(1, Some(7), 50, 51),
            read(1, Some(7), 60, 61),
        ]),
        Verdict::Linearizable
    );
}

#[test]
fn unknown_write_cannot_take_effect_before_its_invocation() {
    assert!(matches!(
        verdict(&[read(1, Some(1), 0, 1), unknown(0, OpKind::Write(1), 5)]),
        Verdict::NotLinearizable(_)
    ));
}

#[test]
fn unknown_cas_takes_effect_only_where_its_compare_matches() {
    let unknown_cas = unknown(0, OpKind::Cas { from: 1, to: 2 }, 0);
    assert_eq!(
        verdict(&[unknown_cas, write(1, 1, 5, 6), read(1, Some(2), 10, 11)]),
        Verdict::Linearizable
    );
    assert!(matches!(
        verdict(&[unknown_cas, write(1, 3, 5, 6), read(1, Some(2), 10, 11)]),
        Verdict::NotLinearizable(_)
    ));
}

#[test]
fn unknown_read_is_ignored() {
    assert_eq!(
        verdict(&[write(0, 1, 0, 1), unknown(1, OpKind::Read, 2)]),
        Verdict::Linearizable
    );
}

#[test]
fn ok_cas_requires_a_matching_value() {
    assert_eq!(
        verdict(&[
            write(0, 1, 0, 1),
            cas(1, 1, 3, 2, 3),
            read(0, Some(3), 4, 5)
        ]),
        Verdict::Linearizable
    );
    assert!(matches!(
        verdict(&[write(0, 1, 0, 1), cas(1, 2, 3, 2, 3)]),
        Verdict::NotLinearizable(_)
    ));
    // A CAS on the empty register cannot succeed.
    assert!(matches!(
        verdict(&[cas(1, 0, 3, 0, 1)]),
        Verdict::NotLinearizable(_)
    ));
}

#[test]
fn failed_operations_have_no_effect() {
    // The failed CAS would have matched; it still did nothing.
    assert_eq!(
        verdict(&[
            write(0, 1, 0, 1),
            failed(cas(1, 1, 3, 2, 3)),
            read(0, Some(1), 4, 5)
        ]),
        Verdict::Linearizable
    );
    assert!(matches!(
        verdict(&[
            write(0, 1, 0, 1),
            failed(write(1, 3, 2, 3)),
            read(0, Some(3), 4, 5)
        ]),
        Verdict::NotLinearizable(_)
    ));
    // A failed read says nothing about the value.
    assert_eq!(
        verdict(&[write(0, 1, 0, 1), failed(read(1, Some(9), 2, 3))]),
        Verdict::Linearizable
    );
}

#[test]
fn ok_operation_without_completion_must_still_take_effect() {
    let mut never_completes = read(0, Some(7), 0, 0);
    never_completes.completed_at = None;
    assert!(matches!(
        verdict(&[never_completes, write(1, 8, 1, 2)]),
        Verdict::NotLinearizable(_)
    ));
    assert_eq!(
        verdict(&[never_completes, write(1, 7, 1, 2)]),
        Verdict::Linearizable
    );
}

#[test]
fn keys_are_checked_independently() {
    // Interleaved writes on two keys; each key's reads see its own writes.
    let history = [
        on_key(write(0, 1, 0, 1), 0),
        on_key(write(1, 2, 0, 1), 1),
        on_key(read(2, None, 0, 1), 2),
        on_key(read(0, Some(2), 2, 3), 1),
        on_key(read(1, Some(1), 2, 3), 0),
    ];
    assert_eq!(verdict(&history), Verdict::Linearizable);

    // Key 1 reads key 0's value: only key 1 is wrong.
    let mut history = history.to_vec();
    history.push(on_key(read(3, Some(1), 4, 5), 1));
    let violation = violation(&history);
    assert_eq!(violation.key, 1);
    assert!(violation.linearized.iter().all(|o| o.key == 1));
}

#[test]
fn completion_before_invocation_is_an_invalid_history() {
    let backwards = write(0, 1, 5, 4);
    assert_eq!(
        verdict(&[backwards]),
        Verdict::InvalidHistory {
            operation: backwards
        }
    );
    assert!(!verdict(&[backwards]).is_decided());
}

/// Many concurrent writes and a final read of a value nobody wrote: the
/// search must try every order before it can say no.
fn expensive_history(key: u64) -> Vec<Operation> {
    let mut history: Vec<Operation> = (0..10)
        .map(|client| on_key(write(client, client, 0, 100), key))
        .collect();
    history.push(on_key(read(99, Some(1000), 101, 102), key));
    history
}

#[test]
fn exhausted_step_budget_is_undecided_not_a_guess() {
    let history = History {
        operations: expensive_history(3),
    };
    let options = CheckOptions {
        steps_per_key_max: 50,
        ..CheckOptions::default()
    };
    assert_eq!(
        check_with(&history, options),
        Verdict::Undecided {
            key: 3,
            reason: UndecidedReason::StepsExhausted {
                steps_per_key_max: 50
            }
        }
    );
    // With the default budget the same history is decided.
    assert!(matches!(check(&history), Verdict::NotLinearizable(_)));
}

#[test]
fn full_memo_table_is_undecided() {
    let history = History {
        operations: expensive_history(0),
    };
    let options = CheckOptions {
        cache_entries_max: 5,
        ..CheckOptions::default()
    };
    assert_eq!(
        check_with(&history, options),
        Verdict::Undecided {
            key: 0,
            reason: UndecidedReason::CacheFull {
                cache_entries_max: 5
            }
        }
    );
}

#[test]
fn a_decided_violation_beats_an_undecided_key() {
    // Key 0 is cheap and wrong; key 1 would need a large search. Key order
    // puts the violation first, so it is found before the budget runs out.
    let mut operations = vec![write(0, 1, 0, 1), read(1, None, 2, 3)];
    operations.extend(expensive_history(1));
    let options = CheckOptions {
        steps_per_key_max: 60,
        ..CheckOptions::default()
    };
    assert!(matches!(
        check_with(&History { operations }, options),
        Verdict::NotLinearizable(v) if v.key == 0
    ));
    // When the hard key comes first, the wrong key still gets a budget of
    // its own and is reported.
    let mut operations = expensive_history(0);
    operations.push(on_key(write(0, 1, 0, 1), 1));
    operations.push(on_key(read(1, None, 2, 3), 1));
    let verdict = check_with(&History { operations }, options);
    assert!(matches!(verdict, Verdict::NotLinearizable(v) if v.key == 1));
}

#[test]
fn verdicts_display_for_people() {
    let history = [write(1, 5, 0, 1), read(0, None, 2, 3)];
    let text = verdict(&history).to_string();
    assert!(text.starts_with("not linearizable: key 0"), "{text}");
    assert!(text.contains("register = 5"), "{text}");
    assert!(text.contains("client 0 read => ok nil"), "{text}");
}

// ---------------------------------------------------------------------------
// Property tests.

/// A random register operation before it is given an interval.
#[derive(Clone, Copy, Debug)]
enum Action {
    Read,
    Write(u64),
    Cas(u64, u64),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        Just(Action::Read),
        (0..4u64).prop_map(Action::Write),
        (0..4u64, 0..4u64).prop_map(|(from, to)| Action::Cas(from, to)),
    ]
}

/// Per operation: key, action, how far before and after its linearization
/// point its interval reaches, and a choice of how the client hears about it.
type Step = (u64, Action, u64, u64, u8);

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec((0..3u64, action(), 0..60u64, 0..60u64, 0..10u8), 0..40)
}

/// Steps on one key with two values and half of the outcomes unknown (a
/// quarter never took effect), so that identical unknown operations and
/// many ways to combine them are common.
fn unknown_heavy_steps() -> impl Strategy<Value = Vec<Step>> {
    let two_valued = prop_oneof![
        Just(Action::Read),
        (0..2u64).prop_map(Action::Write),
        (0..2u64, 0..2u64).prop_map(|(from, to)| Action::Cas(from, to)),
    ];
    prop::collection::vec((Just(0u64), two_valued, 0..40u64, 0..40u64, 0..4u8), 0..30)
}

/// Builds a history from a sequential run: each operation takes effect at
/// its own instant `10 * i + 1000`, and its interval is stretched around
/// that instant, so operations overlap at random but the sequential order
/// is always a valid linearization. Some operations become unknown (they
/// took effect, or, for "phantoms", did not) or failed (they did not).
fn history_from_sequential_run(steps: &[Step]) -> History {
    let mut values: [Option<u64>; 3] = [None; 3];
    let mut operations = Vec::new();
    for (i, &(key, action, before, after, fate)) in steps.iter().enumerate() {
        let point = 10 * i as u64 + 1000;
        let interval = (point - before, Some(point + after));
        let value = &mut values[key as usize];
        let client = i as u64;
        let (kind, took_effect_as) = match action {
            Action::Read => (OpKind::Read, Some(Outcome::Ok { read: *value })),
            Action::Write(v) => (OpKind::Write(v), Some(Outcome::Ok { read: None })),
            Action::Cas(from, to) => (
                OpKind::Cas { from, to },
                (*value == Some(from)).then_some(Outcome::Ok { read: None }),
            ),
        };
        let phantom = fate == 0;
        let unknown_outcome = fate == 1;
        let outcome = match took_effect_as {
            Some(ok) if !phantom => {
                match action {
                    Action::Read => {}
                    Action::Write(v) => *value = Some(v),
                    Action::Cas(_, to) => *value = Some(to),
                }
                if unknown_outcome {
                    Outcome::Unknown
                } else {
                    ok
                }
            }
            // Did not take effect: a failure, or a timeout that never landed.
            Some(_) | None => {
                if unknown_outcome || phantom {
                    Outcome::Unknown
                } else {
                    Outcome::Fail
                }
            }
        };
        let interval = match outcome {
            Outcome::Unknown => (interval.0, None),
            Outcome::Ok { .. } | Outcome::Fail => interval,
        };
        operations.push(op(client, key, kind, interval, outcome));
    }
    History { operations }
}

/// Brute force: tries every order of the operations that respects real
/// time, with every subset of the unknown ones left out. Only for a handful
/// of operations (recursion and factorial time are fine here).
fn brute_force_linearizable(operations: &[Operation]) -> bool {
    let relevant: Vec<Operation> = operations
        .iter()
        .copied()
        .filter(|o| match (o.outcome, o.kind) {
            (Outcome::Fail, _) | (Outcome::Unknown, OpKind::Read) => false,
            (Outcome::Ok { .. } | Outcome::Unknown, _) => true,
        })
        .collect();
    fn required(o: &Operation) -> bool {
        matches!(o.outcome, Outcome::Ok { .. })
    }
    fn apply(o: &Operation, value: Option<u64>) -> Option<Option<u64>> {
        match (o.kind, o.outcome) {
            (OpKind::Read, Outcome::Ok { read }) => (read == value).then_some(value),
            (OpKind::Read, _) => unreachable!("filtered"),
            (OpKind::Write(v), _) => Some(Some(v)),
            (OpKind::Cas { from, to }, _) => (value == Some(from)).then_some(Some(to)),
        }
    }
    fn search(ops: &[Operation], placed: &mut Vec<bool>, value: Option<u64>) -> bool {
        let all_required_placed = ops
            .iter()
            .zip(placed.iter())
            .all(|(o, &p)| p || !required(o));
        if all_required_placed {
            return true;
        }
        for next in 0..ops.len() {
            if placed[next] {
                continue;
            }
            // Everything unplaced that completed before `next` started
            // would have to come first.
            let blocked = (0..ops.len()).any(|other| {
                other != next
                    && !placed[other]
                    && ops[other]
                        .completed_at
                        .is_some_and(|done| required(&ops[other]) && done < ops[next].invoked_at)
            });
            if blocked {
                continue;
            }
            if let Some(after) = apply(&ops[next], value) {
                placed[next] = true;
                if search(ops, placed, after) {
                    return true;
                }
                placed[next] = false;
            }
        }
        false
    }
    let mut placed = vec![false; relevant.len()];
    search(&relevant, &mut placed, None)
}

/// Small histories of one key with random intervals and outcomes, most of
/// them not linearizable; `unknown_weight` sets how many outcomes are
/// unknown (against 7 for the others).
fn small_random_history(
    unknown_weight: u32,
    operations_max: usize,
) -> impl Strategy<Value = Vec<Operation>> {
    let one = (
        action(),
        0..20u64,
        0..12u64,
        prop_oneof![
            4 => (0..3u64).prop_map(|v| Outcome::Ok { read: Some(v) }),
            2 => Just(Outcome::Ok { read: None }),
            1 => Just(Outcome::Fail),
            unknown_weight => Just(Outcome::Unknown),
        ],
        0..20u8,
    );
    prop::collection::vec(one, 0..=operations_max).prop_map(|ops| {
        ops.into_iter()
            .enumerate()
            .map(|(i, (action, start, length, outcome, no_completion))| {
                let kind = match action {
                    Action::Read => OpKind::Read,
                    Action::Write(v) => OpKind::Write(v % 3),
                    Action::Cas(from, to) => OpKind::Cas {
                        from: from % 3,
                        to: to % 3,
                    },
                };
                let completed_at = match outcome {
                    Outcome::Unknown => None,
                    // Rarely an Ok operation whose completion was never seen.
                    Outcome::Ok { .. } | Outcome::Fail if no_completion == 0 => None,
                    Outcome::Ok { .. } | Outcome::Fail => Some(start + length),
                };
                op(i as u64, 0, kind, (start, completed_at), outcome)
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn histories_of_sequential_runs_are_linearizable(steps in steps()) {
        let history = history_from_sequential_run(&steps);
        prop_assert_eq!(check(&history), Verdict::Linearizable);
    }

    #[test]
    fn a_read_of_a_never_written_value_is_not_linearizable(
        steps in steps(),
        key in 0..3u64,
        start in 900..1500u64,
        length in 0..100u64,
    ) {
        let mut history = history_from_sequential_run(&steps);
        history.operations.push(op(
            999,
            key,
            OpKind::Read,
            (start, Some(start + length)),
            Outcome::Ok { read: Some(77) },
        ));
        match check(&history) {
            Verdict::NotLinearizable(violation) => prop_assert_eq!(violation.key, key),
            other => prop_assert!(false, "expected a violation on key {}, got {:?}", key, other),
        }
    }

    #[test]
    fn checker_agrees_with_brute_force(operations in small_random_history(2, 7)) {
        let expected = brute_force_linearizable(&operations);
        let verdict = check(&History { operations: operations.clone() });
        match verdict {
            Verdict::Linearizable => prop_assert!(expected, "checker says linearizable"),
            Verdict::NotLinearizable(_) => prop_assert!(!expected, "checker says not linearizable"),
            other => prop_assert!(false, "undecided on a tiny history: {:?}", other),
        }
    }

    /// Each search mode on its own, on histories full of unknown outcomes
    /// (where the pruning rules for them matter): the exact modes must
    /// match the oracle, and the relaxed mode may only say "no" when the
    /// oracle does.
    #[test]
    fn each_search_mode_agrees_with_brute_force(operations in small_random_history(6, 8)) {
        let expected = brute_force_linearizable(&operations);
        for mode in [Mode::Eager, Mode::Layered] {
            match search::check_key_in_mode(0, &operations, mode) {
                KeyResult::Linearizable => prop_assert!(expected, "{:?} says linearizable", mode),
                KeyResult::NotLinearizable(_) => {
                    prop_assert!(!expected, "{:?} says not linearizable", mode)
                }
                KeyResult::Undecided(reason) => prop_assert!(false, "{:?} undecided: {}", mode, reason),
            }
        }
        match search::check_key_in_mode(0, &operations, Mode::Relaxed) {
            KeyResult::Linearizable => {}
            KeyResult::NotLinearizable(_) => prop_assert!(!expected, "relaxed says not linearizable"),
            KeyResult::Undecided(reason) => prop_assert!(false, "relaxed undecided: {}", reason),
        }
    }

    /// Histories with a known linearization and many unknown outcomes:
    /// every mode must find one (a pruning rule that cuts too much says no).
    #[test]
    fn every_mode_accepts_sequential_runs_full_of_unknowns(steps in unknown_heavy_steps()) {
        let history = history_from_sequential_run(&steps);
        for mode in [Mode::Relaxed, Mode::Eager, Mode::Layered] {
            let result = search::check_key_in_mode(0, &history.operations, mode);
            prop_assert_eq!(result, KeyResult::Linearizable, "{:?}", mode);
        }
    }

    /// Histories whose written values are all distinct, where the
    /// reductions of unknown outcomes apply most (an unread unknown write
    /// is left out; a read unknown write took effect before its reader):
    /// the checker must still agree with the oracle.
    #[test]
    fn reductions_of_unknown_outcomes_keep_the_verdict(operations in small_random_history(8, 8)) {
        let mut next_value = 10;
        let operations: Vec<Operation> = operations
            .into_iter()
            .map(|mut o| {
                match &mut o.kind {
                    OpKind::Write(value) | OpKind::Cas { to: value, .. } => {
                        *value = next_value;
                        next_value += 1;
                    }
                    OpKind::Read => {}
                }
                o
            })
            .collect();
        // Reads and compares look for the written values (or miss them).
        let values = next_value;
        let operations: Vec<Operation> = operations
            .into_iter()
            .map(|mut o| {
                let pick = |v: u64| 10 + (v * 7 + o.invoked_at) % (values - 9);
                match (&mut o.kind, &mut o.outcome) {
                    (OpKind::Read, Outcome::Ok { read: Some(value) }) => *value = pick(*value),
                    (OpKind::Cas { from, .. }, _) => *from = pick(*from),
                    _ => {}
                }
                o
            })
            .collect();
        let expected = brute_force_linearizable(&operations);
        match check(&History { operations: operations.clone() }) {
            Verdict::Linearizable => prop_assert!(expected, "checker says linearizable"),
            Verdict::NotLinearizable(_) => prop_assert!(!expected, "checker says not linearizable"),
            other => prop_assert!(false, "undecided on a tiny history: {:?}", other),
        }
    }

    /// Past the oracle's reach, the two exact modes must still agree.
    #[test]
    fn exact_modes_agree_on_larger_histories(operations in small_random_history(4, 30)) {
        let eager = search::check_key_in_mode(0, &operations, Mode::Eager);
        let layered = search::check_key_in_mode(0, &operations, Mode::Layered);
        let decided = |result: &KeyResult| match result {
            KeyResult::Linearizable => Some(true),
            KeyResult::NotLinearizable(_) => Some(false),
            KeyResult::Undecided(_) => None,
        };
        prop_assert!(decided(&eager).is_some() && decided(&layered).is_some());
        prop_assert_eq!(decided(&eager), decided(&layered));
    }

    #[test]
    fn parser_never_panics(text in "(INFO  jepsen.util - [0-9:a-z]{0,3}[\t ]{1,2}:?[a-z]{0,6}[\t ]:?[a-z]{0,5}[\t ][\\[\\]0-9 nil]{0,6}\n){0,6}") {
        let _ = parse(&text);
    }
}

// ---------------------------------------------------------------------------
// The Jepsen parser.

const SAMPLE: &str = "\
INFO  jepsen.util - 0\t:invoke\t:read\tnil
INFO  jepsen.util - 1\t:invoke\t:write\t4
INFO  jepsen.util - 0\t:ok\t:read\tnil
INFO  jepsen.util - 2\t:invoke\t:cas\t[4 1]
INFO  jepsen.util - 1\t:info\t:write\t:timed-out
INFO  jepsen.util - :nemesis\t:info\t:start\tnil

INFO  jepsen.util - 2\t:fail\t:cas\t[4 1]
INFO  jepsen.util - 3\t:invoke\t:read\tnil
INFO  jepsen.util - 3\t:ok\t:read\t4
INFO  jepsen.util - 4\t:invoke\t:cas\t[4 0]
INFO  jepsen.util - 4\t:ok\t:cas\t[4 0]
INFO  jepsen.util - 0\t:invoke\t:write\t2
";

#[test]
fn parses_every_line_type() {
    let history = parse(SAMPLE).unwrap();
    let expected = vec![
        op(0, 0, OpKind::Read, (1, Some(3)), Outcome::Ok { read: None }),
        op(1, 0, OpKind::Write(4), (2, None), Outcome::Unknown),
        op(
            2,
            0,
            OpKind::Cas { from: 4, to: 1 },
            (4, Some(8)),
            Outcome::Fail,
        ),
        op(
            3,
            0,
            OpKind::Read,
            (9, Some(10)),
            Outcome::Ok { read: Some(4) },
        ),
        op(
            4,
            0,
            OpKind::Cas { from: 4, to: 0 },
            (11, Some(12)),
            Outcome::Ok { read: None },
        ),
        // Never answered: unknown.
        op(0, 0, OpKind::Write(2), (13, None), Outcome::Unknown),
    ];
    assert_eq!(history.operations, expected);
    assert_eq!(check(&history), Verdict::Linearizable);
}

#[test]
fn fields_may_be_separated_by_any_whitespace() {
    let tabs =
        "INFO  jepsen.util - 4\t:invoke\t:cas\t[4 0]\nINFO  jepsen.util - 4\t:ok\t:cas\t[4 0]\n";
    let spaces = "INFO jepsen.util - 4 :invoke :cas [4 0]\r\n  INFO  jepsen.util -  4  :ok  :cas  [4  0]  \r\n";
    assert_eq!(parse(tabs).unwrap(), parse(spaces).unwrap());
    assert_eq!(parse(tabs).unwrap().operations.len(), 1);
}

fn parse_problem(text: &str) -> (u64, ParseProblem) {
    match parse(text) {
        Err(error) => (error.line, error.problem),
        Ok(history) => panic!("expected an error, parsed {history:?}"),
    }
}

#[test]
fn malformed_lines_are_reported_with_their_line_number() {
    let ok_line = "INFO  jepsen.util - 0\t:invoke\t:read\tnil\n";
    let cases: Vec<(String, ParseProblem)> = vec![
        (
            "garbage".to_string(),
            ParseProblem::Shape {
                found: "garbage".to_string(),
            },
        ),
        (
            "INFO  jepsen.util - 0\t:invoke\t:read".to_string(),
            ParseProblem::Shape {
                found: "INFO  jepsen.util - 0\t:invoke\t:read".to_string(),
            },
        ),
        (
            "INFO  jepsen.util - x\t:invoke\t:read\tnil".to_string(),
            ParseProblem::Process {
                found: "x".to_string(),
            },
        ),
        (
            "INFO  jepsen.util - -1\t:invoke\t:read\tnil".to_string(),
            ParseProblem::Process {
                found: "-1".to_string(),
            },
        ),
        (
            "INFO  jepsen.util - 1\t:begin\t:read\tnil".to_string(),
            ParseProblem::Type {
                found: ":begin".to_string(),
            },
        ),
        (
            "INFO  jepsen.util - 1\t:invoke\t:append\t3".to_string(),
            ParseProblem::Function {
                found: ":append".to_string(),
            },
        ),
        (
            "INFO  jepsen.util - 1\t:invoke\t:write\tnil".to_string(),
            ParseProblem::Value {
                found: "nil".to_string(),
                expected: "a non-negative integer",
            },
        ),
        (
            "INFO  jepsen.util - 1\t:invoke\t:cas\t[1 2 3]".to_string(),
            ParseProblem::Value {
                found: "[1 2 3]".to_string(),
                expected: "`[FROM TO]` with non-negative integers",
            },
        ),
        (
            "INFO  jepsen.util - 1\t:ok\t:read\t3".to_string(),
            ParseProblem::CompletionWithoutInvocation { process: 1 },
        ),
        (
            "INFO  jepsen.util - 0\t:invoke\t:write\t3".to_string(),
            ParseProblem::InvocationWhileOpen {
                process: 0,
                open_line: 1,
            },
        ),
        (
            "INFO  jepsen.util - 0\t:ok\t:write\t3".to_string(),
            ParseProblem::CompletionMismatch {
                process: 0,
                found: ":write 3".to_string(),
                invoked: ":read".to_string(),
                invoked_line: 1,
            },
        ),
        (
            "INFO  jepsen.util - 0\t:ok\t:read\tseven".to_string(),
            ParseProblem::Value {
                found: "seven".to_string(),
                expected: "`nil` or a non-negative integer",
            },
        ),
    ];
    for (bad_line, problem) in cases {
        let text = format!("{ok_line}{bad_line}\n{ok_line}");
        assert_eq!(parse_problem(&text), (2, problem), "{bad_line}");
    }
}

#[test]
fn completion_values_must_match_the_invocation() {
    let text = "INFO  jepsen.util - 0\t:invoke\t:cas\t[1 2]\n\
                INFO  jepsen.util - 0\t:ok\t:cas\t[1 3]\n";
    assert!(matches!(
        parse_problem(text),
        (2, ParseProblem::CompletionMismatch { process: 0, .. })
    ));
}

#[test]
fn parse_errors_read_well() {
    let error = parse("INFO  jepsen.util - 0\t:ok\t:read\t3\n").unwrap_err();
    assert_eq!(
        error.to_string(),
        "line 1: process 0 completes an operation it never invoked"
    );
}
