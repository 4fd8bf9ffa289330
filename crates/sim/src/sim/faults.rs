//! Fault injection: crashes and restarts, pauses, partitions, clogged
//! links, clock jumps and drift, drawn from the run's generator. Every
//! fault is the node's or the link's, so it strikes all the groups a node
//! hosts, or all the groups a link carries, at once.

use super::*;

/// Inputs a resumed node takes per turn (the runtime worker's bound on a
/// turn, `INPUTS_PER_TURN_MAX`).
const RESUME_INPUTS_PER_TURN: usize = 256;

impl Simulation {
    pub(super) fn next_fault(&mut self) {
        if self.phase != Phase::Main {
            return;
        }
        let f = self.config.faults.clone();
        let next = self.rng.range(1, 2 * f.mean_interval_us);
        self.schedule(next, Event::NextFault);
        let weights = [
            f.crash_weight,
            f.pause_weight,
            f.partition_weight,
            f.clog_weight,
            f.clock_jump_weight,
            f.drift_weight,
            self.config.disk.fault_weight,
        ];
        let total: u64 = weights.iter().sum();
        if total == 0 {
            return;
        }
        let mut draw = self.rng.range(0, total);
        let mut kind = 0;
        for (i, w) in weights.iter().enumerate() {
            if draw < *w {
                kind = i;
                break;
            }
            draw -= w;
        }
        let running: Vec<NodeId> = self
            .nodes
            .values()
            .filter(|n| n.running())
            .map(|n| n.id)
            .collect();
        let election_ticks = u64::from(self.config.engine.election_timeout_ticks);
        match kind {
            0 => {
                let crashed = self
                    .nodes
                    .values()
                    .filter(|n| n.started && !n.running())
                    .count();
                if crashed >= f.crashed_max {
                    return;
                }
                if let Some(&victim) = self.rng.pick(&running) {
                    self.crash(victim);
                    let down = self.rng.range(1, 6 * election_ticks) * TICK_US;
                    self.schedule(down, Event::Restart { node: victim });
                }
            }
            1 => {
                let candidates: Vec<NodeId> = running
                    .iter()
                    .copied()
                    .filter(|id| self.nodes.get(id).is_some_and(|n| !n.paused))
                    .collect();
                if let Some(&victim) = self.rng.pick(&candidates) {
                    if let Some(n) = self.nodes.get_mut(&victim) {
                        n.paused = true;
                    }
                    self.log(Some(victim), "pause");
                    // Now and then a long stop, like a VM migration: the
                    // backlog then overflows the inbox.
                    let longest = if self.rng.chance_percent(20) { 30 } else { 8 };
                    let duration = self.rng.range(1, longest * election_ticks) * TICK_US;
                    self.schedule(duration, Event::Resume { node: victim });
                }
            }
            2 => {
                if !self.net.partition().blocked.is_empty() {
                    self.apply_partition(Partition::default());
                    return;
                }
                let ids = self.all_ids.clone();
                let partition = match self.rng.range(0, 3) {
                    0 => {
                        let side = ids
                            .iter()
                            .copied()
                            .filter(|_| self.rng.chance_percent(50))
                            .collect();
                        Partition::halves(&ids, &side)
                    }
                    1 => match self.rng.pick(&ids) {
                        Some(&node) => Partition::isolate(&ids, node),
                        None => return,
                    },
                    _ => {
                        let count = self.rng.range_inclusive(1, ids.len() as u64);
                        let mut links = Vec::new();
                        for _ in 0..count {
                            let a = ids[self.rng.index(ids.len()).unwrap_or(0)];
                            let b = ids[self.rng.index(ids.len()).unwrap_or(0)];
                            if a != b {
                                links.push((a, b));
                            }
                        }
                        self.coverage.hit(Counter::OneWayPartition);
                        Partition::one_way(links)
                    }
                };
                self.apply_partition(partition);
                let generation = self.partition_generation;
                let duration = self.rng.range(1, 10 * election_ticks) * TICK_US;
                self.schedule(duration, Event::HealPartition { generation });
            }
            3 => {
                let ids = self.all_ids.clone();
                let a = ids[self.rng.index(ids.len()).unwrap_or(0)];
                let b = ids[self.rng.index(ids.len()).unwrap_or(0)];
                if a == b || self.net.is_clogged(a, b) {
                    return;
                }
                self.net.clog(a, b);
                self.log(None, &format!("clog n{a}->n{b}"));
                let duration = self.rng.range(1, 6 * election_ticks) * TICK_US;
                self.schedule(duration, Event::Unclog { from: a, to: b });
            }
            4 => {
                let candidates: Vec<NodeId> = running
                    .iter()
                    .copied()
                    .filter(|id| self.nodes.get(id).is_some_and(|n| !n.paused))
                    .collect();
                if let Some(&node) = self.rng.pick(&candidates) {
                    let ticks = self.rng.range_inclusive(1, 2 * election_ticks);
                    self.log(Some(node), &format!("clock jumps {ticks} ticks"));
                    self.coverage.hit(Counter::ClockJump);
                    'ticks: for _ in 0..ticks {
                        for group in self.group_ids() {
                            if self.failure.is_some() || !self.is_running(node) {
                                break 'ticks;
                            }
                            self.step(node, group, Input::Tick);
                        }
                    }
                }
            }
            6 => self.next_disk_fault(),
            _ => {
                if let Some(&node) = self.rng.pick(&running) {
                    let period = Self::drifted_period(&mut self.rng, f.drift_percent_max);
                    if let Some(n) = self.nodes.get_mut(&node) {
                        n.tick_period_us = period;
                    }
                    self.log(Some(node), &format!("clock rate: tick every {period}us"));
                }
            }
        }
    }

    pub(super) fn apply_partition(&mut self, partition: Partition) {
        let ids = self.all_ids.clone();
        let healing = partition.blocked.is_empty() && !self.net.partition().blocked.is_empty();
        self.partition_generation += 1;
        self.log(None, &format!("partition blocked={:?}", partition.blocked));
        let (broke, restored) = self.net.set_partition(partition, &ids);
        if healing {
            self.coverage.hit(Counter::PartitionHealed);
        }
        // The connection is the pair's: every group on both sides hears.
        for (a, b) in broke {
            self.connection_broke(a, b);
            self.feed_all(a, Input::PeerDisconnected(b));
            self.feed_all(b, Input::PeerDisconnected(a));
        }
        for (a, b) in restored {
            if self.is_running(a) && self.is_running(b) {
                self.connect_pair(a, b);
            }
        }
    }

    pub(super) fn crash(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        if !node.running() {
            return;
        }
        let unsynced = node.disk.has_unsynced();
        if unsynced {
            self.coverage.hit(Counter::UnsyncedWritesLost);
        }
        if node.real.is_some() {
            let mut acknowledged = BTreeMap::new();
            for (group, replica) in (1..).zip(node.replicas.iter_mut()) {
                let Some(disk) = node.disk.group(group) else {
                    continue;
                };
                acknowledged.insert(
                    group,
                    crate::real_storage::Acknowledged {
                        synced: disk.synced().clone(),
                        pending: disk.pending_requests(),
                        snapshot_attempt: replica.snapshot_attempt.take(),
                    },
                );
            }
            node.restart_check = Some(acknowledged);
            let mode = self.draw_crash_mode();
            let Some(node) = self.nodes.get_mut(&id) else {
                return;
            };
            if let Some(real) = node.real.as_mut() {
                real.crash(mode);
            }
            if unsynced && mode != ferry_storage::CrashMode::KeepWritten {
                self.coverage.hit(Counter::DiskUnsyncedLost);
            }
        }
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        node.disk.crash();
        for replica in node.replicas.iter_mut() {
            replica.engine = None;
            replica.snapshot_in_progress = false;
        }
        node.paused = false;
        node.inbox.clear();
        self.log(Some(id), "crash");
        // Clients connected to it lose their connection.
        let owned: Vec<(NodeId, RequestId)> = self
            .owners
            .range((id, RequestId(0))..=(id, RequestId(u64::MAX)))
            .map(|(k, _)| *k)
            .collect();
        for key in owned {
            if let Some(Owner::Client { slot, uid }) = self.owners.remove(&key) {
                self.client_connection_lost(slot, uid);
            }
        }
        for slot in 0..self.clients.len() {
            if let Some(op) = self.clients[slot].op {
                if let Awaiting::Apply { node, .. } = op.awaiting {
                    if node == id {
                        self.client_connection_lost(slot, op.uid);
                    }
                }
            }
        }
        let peers: Vec<NodeId> = self.all_ids.iter().copied().filter(|&p| p != id).collect();
        for peer in peers {
            if self.net.connected(id, peer) {
                self.connection_broke(id, peer);
                self.feed_all(peer, Input::PeerDisconnected(id));
            }
        }
    }

    pub(super) fn resume(&mut self, id: NodeId) {
        let inbox = match self.nodes.get_mut(&id) {
            Some(n) if n.paused => {
                n.paused = false;
                std::mem::take(&mut n.inbox)
            }
            _ => return,
        };
        self.log(
            Some(id),
            &format!("resume with {} queued inputs", inbox.len()),
        );
        self.coverage.hit(Counter::PausedNodeResumed);
        // As the runtime's worker takes a backlog: up to a turn's worth of
        // inputs at a time, each group's stepped as one batch, except the
        // inputs it steps on their own (ticks, link changes), before which
        // the group's batch is stepped.
        let mut batches: BTreeMap<GroupId, Vec<Input>> = BTreeMap::new();
        let mut taken = 0;
        for (group, input) in inbox {
            if self.failure.is_some() || !self.is_running(id) {
                return;
            }
            match input {
                Input::Message(_) | Input::Client { .. } | Input::Persisted { .. } => {
                    batches.entry(group).or_default().push(input);
                }
                other => {
                    let batch = batches.remove(&group).unwrap_or_default();
                    self.step_inputs(id, group, batch);
                    self.step(id, group, other);
                }
            }
            taken += 1;
            if taken % RESUME_INPUTS_PER_TURN == 0 {
                for (group, batch) in std::mem::take(&mut batches) {
                    self.step_inputs(id, group, batch);
                }
            }
        }
        for (group, batch) in batches {
            if self.failure.is_some() || !self.is_running(id) {
                return;
            }
            self.step_inputs(id, group, batch);
        }
    }

    pub(super) fn unclog(&mut self, from: NodeId, to: NodeId) {
        let held = self.net.unclog(from, to);
        let epochs = self.held_epochs.remove(&(from, to)).unwrap_or_default();
        self.log(
            None,
            &format!("unclog n{from}->n{to} releasing {}", held.len()),
        );
        self.coverage.hit(Counter::LinkClogHealed);
        for (i, message) in held.into_iter().enumerate() {
            let delay = self.net.delay_us(&mut self.rng);
            // The connection the message was sent on, not today's.
            let epoch = epochs
                .get(i)
                .copied()
                .unwrap_or_else(|| self.connection_epoch(message.from, message.to));
            self.schedule(delay, Event::Deliver { message, epoch });
        }
    }
}
