//! The register workload: clients that invoke reads, writes and
//! compare-and-set, retry definite refusals, learn outcomes from the state
//! machine, and record the history. With several groups per node each
//! operation goes to one of the active groups (idle groups get none), whose
//! registers are its own, and is recorded in that group's history.

use super::*;

impl Simulation {
    pub(super) fn client_timeout_us(&self) -> u64 {
        let engine = &self.config.engine;
        (3 * u64::from(engine.request_timeout_ticks) + 4 * u64::from(engine.election_timeout_ticks))
            * TICK_US
    }

    /// The group the next operation goes to: one of the active groups,
    /// drawn from the multi-group stream (with one group, group 1 and no draw).
    fn pick_client_group(&mut self) -> GroupId {
        if self.config.groups <= 1 {
            return GROUP;
        }
        let active = self.config.active_group_ids();
        self.group_rng.pick(&active).copied().unwrap_or(GROUP)
    }

    /// The group named in a client's trace line, when there are several.
    fn group_tag(&self, group: GroupId) -> String {
        if self.config.groups > 1 {
            format!("g{group} ")
        } else {
            String::new()
        }
    }

    pub(super) fn client_start_op(&mut self, slot: usize) {
        if self.phase != Phase::Main
            || slot >= self.clients.len()
            || self.clients[slot].op.is_some()
        {
            return;
        }
        let group = self.pick_client_group();
        let key = self.rng.range(0, self.config.keys.max(1));
        let kind = match self.rng.range(0, 100) {
            0..=39 => OpKind::Read,
            40..=74 => {
                let v = self.next_value;
                self.next_value += 1;
                OpKind::Write(v)
            }
            _ => {
                let to = self.next_value;
                self.next_value += 1;
                let known = self.last_values.get(&(group, key)).copied();
                let from = match known {
                    Some(v) if self.rng.chance_percent(70) => v,
                    _ if self.next_value > 2 => self.rng.range(1, self.next_value - 1),
                    _ => 1,
                };
                OpKind::Cas { from, to }
            }
        };
        let client = &mut self.clients[slot];
        let op_seq = client.next_op_seq;
        client.next_op_seq += 1;
        let uid = self.next_op_uid;
        self.next_op_uid += 1;
        // Drawn only in runs with lease reads, so that other runs keep their
        // sequence of draws.
        let lease_read =
            kind == OpKind::Read && self.config.engine.lease_reads && self.rng.chance_percent(50);
        let client = &mut self.clients[slot];
        client.op = Some(ClientOp {
            uid,
            op_seq,
            group,
            key,
            kind,
            lease_read,
            invoked_at: self.now_us,
            attempts: 0,
            awaiting: Awaiting::Backoff,
        });
        let client_id = client.client_id;
        let tag = self.group_tag(group);
        self.log(
            None,
            &format!(
                "client c{client_id} {tag}invoke {} key={key}",
                op_label(kind)
            ),
        );
        let timeout = self.client_timeout_us();
        self.schedule(timeout, Event::ClientDeadline { slot, uid });
        self.client_attempt(slot, None);
    }

    pub(super) fn client_attempt(&mut self, slot: usize, target: Option<NodeId>) {
        let Some(mut op) = self.clients.get(slot).and_then(|c| c.op) else {
            return;
        };
        let client_id = self.clients[slot].client_id;
        let candidates: Vec<NodeId> = self
            .nodes
            .values()
            .filter(|n| n.started)
            .map(|n| n.id)
            .collect();
        let node = match target {
            Some(t) => t,
            None => match self.rng.pick(&candidates) {
                Some(&n) => n,
                None => return,
            },
        };
        op.attempts += 1;
        self.log_group(
            Some(node),
            op.group,
            &format!(
                "client c{client_id} attempt {} of {}",
                op.attempts,
                op_label(op.kind)
            ),
        );
        if !self.is_running(node) {
            // Connection refused: definitely no effect.
            self.clients[slot].op = Some(op);
            self.client_refused(slot, None);
            return;
        }
        if op.kind == OpKind::Read && self.config.sabotage == Sabotage::LocalReads {
            let value = self
                .group_machine(node, op.group)
                .and_then(|m| m.get(op.key));
            self.clients[slot].op = Some(op);
            self.client_complete(slot, Outcome::Ok { read: value });
            return;
        }
        let request = match op.kind {
            OpKind::Read if op.lease_read => Request::Read(ReadConsistency::Lease),
            OpKind::Read => Request::Read(ReadConsistency::Linearizable),
            OpKind::Write(value) => Request::Propose(
                Command::Write {
                    client: client_id,
                    op_seq: op.op_seq,
                    key: op.key,
                    value,
                }
                .encode(),
            ),
            OpKind::Cas { from, to } => Request::Propose(
                Command::Cas {
                    client: client_id,
                    op_seq: op.op_seq,
                    key: op.key,
                    from,
                    to,
                }
                .encode(),
            ),
        };
        let Some(n) = self.nodes.get_mut(&node) else {
            return;
        };
        let request_id = RequestId(n.next_request_id);
        n.next_request_id += 1;
        op.awaiting = Awaiting::Response {
            node,
            request: request_id,
        };
        self.clients[slot].op = Some(op);
        self.owners
            .insert((node, request_id), Owner::Client { slot, uid: op.uid });
        self.feed(
            node,
            op.group,
            Input::Client {
                id: request_id,
                request,
            },
        );
    }

    /// A definite refusal: retry (elsewhere, or at the named leader) or give up.
    pub(super) fn client_refused(&mut self, slot: usize, leader_hint: Option<NodeId>) {
        let Some(mut op) = self.clients.get(slot).and_then(|c| c.op) else {
            return;
        };
        if op.attempts >= CLIENT_ATTEMPTS_MAX {
            self.client_complete(slot, Outcome::Fail);
            return;
        }
        op.awaiting = Awaiting::Backoff;
        self.clients[slot].op = Some(op);
        self.coverage.hit(Counter::ClientRetry);
        let backoff = self.rng.range(1, 4) * TICK_US;
        self.schedule(
            backoff,
            Event::ClientRetry {
                slot,
                uid: op.uid,
                target: leader_hint,
            },
        );
    }

    pub(super) fn client_response(
        &mut self,
        slot: usize,
        uid: u64,
        node: NodeId,
        result: Result<Response, RequestError>,
    ) {
        let Some(op) = self.clients.get(slot).and_then(|c| c.op) else {
            return;
        };
        if op.uid != uid {
            return;
        }
        match (op.kind, result) {
            (OpKind::Read, Ok(Response::ReadReady { index })) => {
                let Some(machine) = self.group_machine(node, op.group) else {
                    return;
                };
                if machine.applied() < index {
                    let applied = machine.applied();
                    self.fail(
                        FailureKind::Contract,
                        format!("{} said a read is ready at {index} but its state machine has applied only {applied}", self.who(node, op.group)),
                    );
                    return;
                }
                let value = machine.get(op.key);
                self.coverage.hit(Counter::ReadOk);
                if op.lease_read {
                    self.coverage.hit(Counter::LeaseReadOk);
                }
                self.client_complete(slot, Outcome::Ok { read: value });
            }
            (OpKind::Write(_) | OpKind::Cas { .. }, Ok(Response::Proposed { index, term })) => {
                if let Some(op) = self.clients[slot].op.as_mut() {
                    op.awaiting = Awaiting::Apply { node, index, term };
                }
                self.resolve_applied(node, op.group, false);
            }
            (_, Ok(other)) => {
                self.fail(
                    FailureKind::Contract,
                    format!(
                        "{} answered a {} with {other:?}",
                        self.who(node, op.group),
                        op_label(op.kind)
                    ),
                );
            }
            (kind, Err(error)) => {
                let tag = self.group_tag(op.group);
                self.log(
                    None,
                    &format!(
                        "client c{} {tag}attempt refused: {error}",
                        self.clients[slot].client_id
                    ),
                );
                if retryable(&error) {
                    let hint = match error {
                        RequestError::NotLeader { leader } => leader,
                        _ => None,
                    };
                    self.client_refused(slot, hint);
                } else if error == RequestError::Timeout && kind != OpKind::Read {
                    self.client_complete(slot, Outcome::Unknown);
                } else {
                    self.client_complete(slot, Outcome::Fail);
                }
            }
        }
    }

    /// Answers proposals to `group` waiting on `node` whose index it has now
    /// applied, from its state machine's session table.
    pub(super) fn resolve_applied(&mut self, id: NodeId, group: GroupId, after_snapshot: bool) {
        for slot in 0..self.clients.len() {
            let Some(op) = self.clients[slot].op else {
                continue;
            };
            let Awaiting::Apply { node, index, .. } = op.awaiting else {
                continue;
            };
            if node != id || op.group != group {
                continue;
            }
            let Some(machine) = self.group_machine(id, group) else {
                continue;
            };
            if machine.applied() < index {
                continue;
            }
            let client_id = self.clients[slot].client_id;
            let outcome = match machine.session(client_id) {
                Some(session) if session.op_seq == op.op_seq => match session.result {
                    CommandResult::Written | CommandResult::Swapped => Outcome::Ok { read: None },
                    CommandResult::CompareFailed => Outcome::Fail,
                },
                _ => Outcome::Fail,
            };
            if after_snapshot {
                self.coverage.hit(Counter::OutcomeFromSnapshot);
            }
            self.client_complete(slot, outcome);
        }
    }

    pub(super) fn client_connection_lost(&mut self, slot: usize, uid: u64) {
        let Some(op) = self.clients.get(slot).and_then(|c| c.op) else {
            return;
        };
        if op.uid != uid {
            return;
        }
        let outcome = match op.kind {
            OpKind::Read => Outcome::Fail,
            OpKind::Write(_) | OpKind::Cas { .. } => Outcome::Unknown,
        };
        self.client_complete(slot, outcome);
    }

    pub(super) fn client_deadline(&mut self, slot: usize, uid: u64) {
        let Some(op) = self.clients.get(slot).and_then(|c| c.op) else {
            return;
        };
        if op.uid != uid {
            return;
        }
        if let Awaiting::Response { node, request } = op.awaiting {
            self.owners.remove(&(node, request));
        }
        let outcome = match (op.kind, op.awaiting) {
            (OpKind::Read, _) => Outcome::Fail,
            // Never reached a node since the last definite refusal: no effect.
            (_, Awaiting::Backoff) => Outcome::Fail,
            _ => Outcome::Unknown,
        };
        self.client_complete(slot, outcome);
    }

    pub(super) fn client_complete(&mut self, slot: usize, outcome: Outcome) {
        let Some(op) = self.clients.get_mut(slot).and_then(|c| c.op.take()) else {
            return;
        };
        let client_id = self.clients[slot].client_id;
        match (op.kind, outcome) {
            (OpKind::Read, Outcome::Ok { read: Some(v) })
            | (OpKind::Write(v), Outcome::Ok { .. }) => {
                self.last_values.insert((op.group, op.key), v);
            }
            (OpKind::Cas { to, .. }, Outcome::Ok { .. }) => {
                self.last_values.insert((op.group, op.key), to);
            }
            _ => {}
        }
        self.histories
            .entry(op.group)
            .or_default()
            .operations
            .push(Operation {
                client: client_id,
                key: op.key,
                kind: op.kind,
                invoked_at: op.invoked_at,
                completed_at: match outcome {
                    Outcome::Unknown => None,
                    Outcome::Ok { .. } | Outcome::Fail => Some(self.now_us),
                },
                outcome,
            });
        self.coverage.hit(match outcome {
            Outcome::Ok { .. } => Counter::ClientOk,
            Outcome::Fail => Counter::ClientFail,
            Outcome::Unknown => Counter::ClientUnknown,
        });
        let tag = self.group_tag(op.group);
        self.log(
            None,
            &format!(
                "client c{client_id} {tag}{} key={} -> {outcome:?}",
                op_label(op.kind),
                op.key
            ),
        );
        if outcome == Outcome::Unknown {
            // A client that does not know its outcome is retired: its
            // operation may still take effect at any time.
            self.clients[slot].client_id = self.next_client_id;
            self.clients[slot].next_op_seq = 1;
            self.next_client_id += 1;
        }
        let think = self.rng.range_inclusive(0, self.config.think_time_max_us);
        self.schedule(think, Event::ClientWake { slot });
    }
}
