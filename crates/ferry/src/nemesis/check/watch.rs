//! The watch guarantees, checked on what every watcher received against
//! each other and against the writes the clients were told succeeded:
//!
//! - **ordered**: events come in revision order, and a stream never goes
//!   back to a revision it has passed;
//! - **unique**: no event is delivered twice (within a stream, or again
//!   after a resume);
//! - **atomic**: the events of one revision come in one response;
//! - **complete**: over the revisions a stream covered (from its start to
//!   the last revision it knows complete: its last event or progress
//!   notification), it has exactly the events every other watcher saw at
//!   those revisions, and every acknowledged write at its revision;
//! - **resumable**: a stream opened after a disconnect, from one past the
//!   last revision known complete, is checked as any other: nothing
//!   missing at the seam, nothing repeated;
//! - **progress never ahead**: after a progress notification at revision
//!   P, no event at P or before arrives on that stream;
//! - **real**: every event put a value some client tried to write to that
//!   key, at the revision the client was told, and no write that certainly
//!   failed shows up.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::nemesis::history::{Op, Outcome, Record, WatchEvent, WatchStep};

/// The watch checker's findings.
#[derive(Debug, Default)]
pub struct WatchReport {
    /// Every violation found, in words.
    pub violations: Vec<String>,
    /// Events received, over every watcher.
    pub events: u64,
    /// Streams opened after the first, over every watcher.
    pub resumes: u64,
    /// Progress notifications received.
    pub progress_notifications: u64,
}

/// One stream of one watcher.
struct Segment {
    watcher: u64,
    start_revision: i64,
    /// Events with the index of the response that carried them.
    events: Vec<(usize, WatchEvent)>,
    /// The highest revision the stream claims complete.
    covered_revision: i64,
}

/// What the clients tried to write, by (key, value).
struct Writes {
    /// For each (key, value) written: the outcome and the revision the
    /// client was told (for an `ok`).
    by_value: HashMap<(String, String), (Outcome, Option<i64>)>,
}

impl Writes {
    fn of(records: &[Record]) -> Writes {
        let mut by_value = HashMap::new();
        for record in records {
            let Record::Op(op) = record else { continue };
            let (key, value) = match &op.op {
                Op::Put { key, value, .. } => (key, value),
                Op::Cas { key, to, .. } => (key, to),
                _ => continue,
            };
            let revision = if op.outcome == Outcome::Ok {
                op.revision
            } else {
                None
            };
            by_value.insert((key.clone(), value.clone()), (op.outcome, revision));
        }
        Writes { by_value }
    }
}

/// Checks every watcher of `records`.
pub fn check(records: &[Record]) -> WatchReport {
    let mut report = WatchReport::default();
    let segments = segments(records, &mut report);
    let writes = Writes::of(records);

    // Every event any watcher saw, by revision.
    let mut seen: BTreeMap<i64, BTreeSet<WatchEvent>> = BTreeMap::new();
    for segment in &segments {
        for (_, event) in &segment.events {
            seen.entry(event.revision)
                .or_default()
                .insert(event.clone());
        }
    }
    check_events_are_real(&seen, &writes, &mut report);
    check_complete(&segments, &seen, &writes, &mut report);
    report
}

/// Splits each watcher's steps into streams, checking order, uniqueness,
/// atomicity and progress on the way.
fn segments(records: &[Record], report: &mut WatchReport) -> Vec<Segment> {
    let mut segments: Vec<Segment> = Vec::new();
    // The open segment of each watcher, as an index into `segments`.
    let mut open: HashMap<u64, usize> = HashMap::new();
    // Per watcher: the highest revision delivered so far, over all its
    // streams, and the (revision, key) pairs delivered.
    let mut delivered: HashMap<u64, (i64, BTreeSet<(i64, String)>)> = HashMap::new();
    let mut response_index = 0usize;
    // Per open segment: the highest progress revision seen in it.
    let mut progress_in: HashMap<usize, i64> = HashMap::new();
    for record in records {
        let Record::Watch(watch) = record else {
            continue;
        };
        let watcher = watch.watcher;
        match &watch.event {
            WatchStep::Open { start_revision, .. } => {
                if delivered.contains_key(&watcher) {
                    report.resumes += 1;
                }
                let (last, _) = delivered.entry(watcher).or_default();
                if *start_revision <= *last {
                    report.violations.push(format!(
                        "watcher {watcher}: resumed from revision {start_revision}, at or before revision {last} it had already received"
                    ));
                }
                segments.push(Segment {
                    watcher,
                    start_revision: *start_revision,
                    events: Vec::new(),
                    covered_revision: start_revision.saturating_sub(1),
                });
                open.insert(watcher, segments.len() - 1);
            }
            WatchStep::Created => {}
            WatchStep::Events { events, .. } => {
                response_index += 1;
                let Some(&index) = open.get(&watcher) else {
                    report
                        .violations
                        .push(format!("watcher {watcher}: events outside any stream"));
                    continue;
                };
                let segment = &mut segments[index];
                let (last, pairs) = delivered.entry(watcher).or_default();
                let progress = progress_in.get(&index).copied().unwrap_or(0);
                let mut previous_in_response: Option<i64> = None;
                for event in events {
                    report.events += 1;
                    if event.revision < segment.start_revision {
                        report.violations.push(format!(
                            "watcher {watcher}: event at revision {} on a stream started at revision {}",
                            event.revision, segment.start_revision
                        ));
                    }
                    match previous_in_response {
                        Some(previous) if event.revision < previous => {
                            report.violations.push(format!(
                                "watcher {watcher}: events out of order in one response: revision {} after {previous}",
                                event.revision
                            ));
                        }
                        Some(_) => {}
                        None if event.revision <= *last => {
                            report.violations.push(format!(
                                "watcher {watcher}: a response starts at revision {}, not after revision {last} already received (out of order, repeated, or one revision split over responses)",
                                event.revision
                            ));
                        }
                        None => {}
                    }
                    previous_in_response = Some(event.revision);
                    if event.revision <= progress {
                        report.violations.push(format!(
                            "watcher {watcher}: event at revision {} arrived after a progress notification at revision {progress}",
                            event.revision
                        ));
                    }
                    if !pairs.insert((event.revision, event.key.clone())) {
                        report.violations.push(format!(
                            "watcher {watcher}: the event of key {} at revision {} was delivered twice",
                            event.key, event.revision
                        ));
                    }
                    segment.events.push((response_index, event.clone()));
                }
                if let Some(max) = events.iter().map(|e| e.revision).max() {
                    *last = (*last).max(max);
                    segment.covered_revision = segment.covered_revision.max(max);
                }
            }
            WatchStep::Progress { revision } => {
                report.progress_notifications += 1;
                let Some(&index) = open.get(&watcher) else {
                    continue;
                };
                let entry = progress_in.entry(index).or_default();
                *entry = (*entry).max(*revision);
                let segment = &mut segments[index];
                segment.covered_revision = segment.covered_revision.max(*revision);
                let (last, _) = delivered.entry(watcher).or_default();
                *last = (*last).max(*revision);
            }
            WatchStep::Cancelled {
                reason,
                compact_revision,
            } => {
                // The test never compacts: no watch may be cancelled.
                report.violations.push(format!(
                    "watcher {watcher}: the watch was cancelled ({reason}; compact revision {compact_revision})"
                ));
                open.remove(&watcher);
            }
            WatchStep::Closed { .. } => {
                open.remove(&watcher);
            }
        }
    }
    segments
}

/// Every event is a write some client tried, at the revision it was told.
fn check_events_are_real(
    seen: &BTreeMap<i64, BTreeSet<WatchEvent>>,
    writes: &Writes,
    report: &mut WatchReport,
) {
    for (revision, events) in seen {
        let mut keys: BTreeMap<&str, u32> = BTreeMap::new();
        for event in events {
            *keys.entry(&event.key).or_default() += 1;
            if event.delete {
                continue;
            }
            match writes.by_value.get(&(event.key.clone(), event.value.clone())) {
                None => report.violations.push(format!(
                    "revision {revision}: put of {}={} that no client wrote",
                    event.key, event.value
                )),
                Some((Outcome::Fail, _)) => report.violations.push(format!(
                    "revision {revision}: put of {}={} whose write certainly failed",
                    event.key, event.value
                )),
                Some((Outcome::Ok, Some(told))) if told != revision => {
                    report.violations.push(format!(
                        "revision {revision}: put of {}={} that its client was told happened at revision {told}",
                        event.key, event.value
                    ))
                }
                Some(_) => {}
            }
        }
        for (key, count) in keys {
            if count > 1 {
                report.violations.push(format!(
                    "revision {revision}: watchers disagree on the event of key {key} ({count} different events)"
                ));
            }
        }
    }
}

/// Over the revisions each stream covered, it holds exactly what every
/// watcher saw there, and every acknowledged write.
fn check_complete(
    segments: &[Segment],
    seen: &BTreeMap<i64, BTreeSet<WatchEvent>>,
    writes: &Writes,
    report: &mut WatchReport,
) {
    // Acknowledged writes, by revision.
    let mut acknowledged: BTreeMap<i64, Vec<(&str, &str)>> = BTreeMap::new();
    for ((key, value), (outcome, revision)) in &writes.by_value {
        if let (Outcome::Ok, Some(revision)) = (outcome, revision) {
            acknowledged
                .entry(*revision)
                .or_default()
                .push((key.as_str(), value.as_str()));
        }
    }
    for segment in segments {
        let range = segment.start_revision..=segment.covered_revision;
        if range.is_empty() {
            continue;
        }
        let mut mine: BTreeMap<i64, BTreeSet<&WatchEvent>> = BTreeMap::new();
        let mut responses: BTreeMap<i64, BTreeSet<usize>> = BTreeMap::new();
        for (response, event) in &segment.events {
            mine.entry(event.revision).or_default().insert(event);
            responses
                .entry(event.revision)
                .or_default()
                .insert(*response);
        }
        for (revision, indices) in &responses {
            if indices.len() > 1 {
                report.violations.push(format!(
                    "watcher {}: the events of revision {revision} came in {} responses, not one",
                    segment.watcher,
                    indices.len()
                ));
            }
        }
        for (revision, events) in seen.range(range.clone()) {
            let have = mine.get(revision).map_or(0, BTreeSet::len);
            let missing: Vec<&WatchEvent> = events
                .iter()
                .filter(|event| !mine.get(revision).is_some_and(|m| m.contains(event)))
                .collect();
            if !missing.is_empty() {
                report.violations.push(format!(
                    "watcher {}: its stream from revision {} covered through revision {} but lacks {} of the {} events other watchers saw at revision {revision} (it has {have}), e.g. {:?}",
                    segment.watcher,
                    segment.start_revision,
                    segment.covered_revision,
                    missing.len(),
                    events.len(),
                    missing[0]
                ));
            }
        }
        for (revision, writes) in acknowledged.range(range) {
            for (key, value) in writes {
                let delivered = mine.get(revision).is_some_and(|events| {
                    events
                        .iter()
                        .any(|e| !e.delete && e.key == *key && e.value == *value)
                });
                if !delivered {
                    report.violations.push(format!(
                        "watcher {}: its stream covered revision {revision} but lacks the acknowledged write {key}={value} at that revision",
                        segment.watcher
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nemesis::history::{OpRecord, WatchRecord};

    fn put_ok(key: &str, value: &str, revision: i64) -> Record {
        Record::Op(OpRecord {
            process: 1,
            member: 1,
            invoked_us: 0,
            completed_us: Some(1),
            op: Op::Put {
                key: key.into(),
                value: value.into(),
                lease: None,
            },
            outcome: Outcome::Ok,
            revision: Some(revision),
            found: None,
            value: None,
            value_lease: None,
            lease: None,
            ttl_secs: None,
            error: None,
        })
    }

    fn step(watcher: u64, event: WatchStep) -> Record {
        Record::Watch(WatchRecord {
            watcher,
            at_us: 0,
            event,
        })
    }

    fn open(watcher: u64, start_revision: i64) -> Record {
        step(
            watcher,
            WatchStep::Open {
                member: 1,
                start_revision,
            },
        )
    }

    fn events(watcher: u64, list: &[(i64, &str, &str)]) -> Record {
        step(
            watcher,
            WatchStep::Events {
                header_revision: list.iter().map(|e| e.0).max().unwrap_or(0),
                events: list
                    .iter()
                    .map(|(revision, key, value)| WatchEvent {
                        revision: *revision,
                        key: key.to_string(),
                        delete: false,
                        value: value.to_string(),
                        lease: 0,
                    })
                    .collect(),
            },
        )
    }

    fn progress(watcher: u64, revision: i64) -> Record {
        step(watcher, WatchStep::Progress { revision })
    }

    fn closed(watcher: u64) -> Record {
        step(
            watcher,
            WatchStep::Closed {
                reason: "test".into(),
                deliberate: true,
            },
        )
    }

    fn writes() -> Vec<Record> {
        vec![
            put_ok("r/1", "10", 2),
            put_ok("r/2", "20", 3),
            put_ok("r/1", "11", 4),
        ]
    }

    fn violations(extra: Vec<Record>) -> Vec<String> {
        let mut records = writes();
        records.extend(extra);
        check(&records).violations
    }

    #[test]
    fn a_complete_stream_resumed_at_the_right_revision_passes() {
        let found = violations(vec![
            open(1, 1),
            events(1, &[(2, "r/1", "10")]),
            progress(1, 2),
            closed(1),
            open(1, 3),
            events(1, &[(3, "r/2", "20"), (4, "r/1", "11")]),
            open(2, 1),
            events(2, &[(2, "r/1", "10"), (3, "r/2", "20")]),
            events(2, &[(4, "r/1", "11")]),
        ]);
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn a_missing_event_is_found_against_the_acknowledged_writes() {
        let found = violations(vec![
            open(1, 1),
            events(1, &[(2, "r/1", "10"), (4, "r/1", "11")]),
        ]);
        assert!(
            found
                .iter()
                .any(|v| v.contains("lacks the acknowledged write r/2=20")),
            "{found:?}"
        );
    }

    #[test]
    fn a_resume_that_skips_a_revision_is_found() {
        // Progress at 3 claimed revision 3 complete while its event had not
        // come: the resume from 4 then misses it for good.
        let found = violations(vec![
            open(1, 1),
            events(1, &[(2, "r/1", "10")]),
            progress(1, 3),
            closed(1),
            open(1, 4),
            events(1, &[(4, "r/1", "11")]),
        ]);
        assert!(found.iter().any(|v| v.contains("r/2=20")), "{found:?}");
    }

    #[test]
    fn an_event_after_a_progress_notification_past_it_is_found() {
        let found = violations(vec![
            open(1, 1),
            events(1, &[(2, "r/1", "10")]),
            progress(1, 4),
            events(1, &[(3, "r/2", "20"), (4, "r/1", "11")]),
        ]);
        assert!(
            found
                .iter()
                .any(|v| v.contains("after a progress notification")),
            "{found:?}"
        );
    }

    #[test]
    fn repeated_split_and_out_of_order_events_are_found() {
        let repeated = violations(vec![
            open(1, 1),
            events(1, &[(2, "r/1", "10")]),
            events(1, &[(2, "r/1", "10")]),
        ]);
        assert!(
            repeated.iter().any(|v| v.contains("delivered twice")),
            "{repeated:?}"
        );
        let out_of_order = violations(vec![
            open(1, 1),
            events(1, &[(3, "r/2", "20"), (2, "r/1", "10")]),
        ]);
        assert!(
            out_of_order.iter().any(|v| v.contains("out of order")),
            "{out_of_order:?}"
        );
        let mut records = vec![put_ok("r/1", "10", 2), put_ok("r/2", "20", 2)];
        records.extend([
            open(1, 1),
            events(1, &[(2, "r/1", "10")]),
            events(1, &[(2, "r/2", "20")]),
        ]);
        let split = check(&records).violations;
        assert!(split.iter().any(|v| v.contains("responses")), "{split:?}");
    }

    #[test]
    fn events_nobody_wrote_or_at_the_wrong_revision_are_found() {
        let found = violations(vec![
            open(1, 1),
            events(1, &[(2, "r/1", "10"), (3, "r/2", "99")]),
        ]);
        assert!(
            found.iter().any(|v| v.contains("no client wrote")),
            "{found:?}"
        );
        let found = violations(vec![open(1, 1), events(1, &[(5, "r/1", "10")])]);
        assert!(
            found
                .iter()
                .any(|v| v.contains("was told happened at revision 2")),
            "{found:?}"
        );
    }

    #[test]
    fn watchers_that_disagree_are_found() {
        let mut records = vec![put_ok("r/1", "10", 2)];
        records.push(Record::Op(OpRecord {
            outcome: Outcome::Unknown,
            completed_us: None,
            revision: None,
            op: Op::Put {
                key: "r/1".into(),
                value: "12".into(),
                lease: None,
            },
            ..match put_ok("r/1", "12", 0) {
                Record::Op(op) => op,
                _ => unreachable!(),
            }
        }));
        records.extend([
            open(1, 1),
            events(1, &[(3, "r/1", "12")]),
            open(2, 1),
            events(2, &[(2, "r/1", "10")]),
            progress(2, 3),
        ]);
        let found = check(&records).violations;
        assert!(
            found.iter().any(|v| v.contains("lacks 1 of the 1 events")),
            "{found:?}"
        );
    }
}
