//! The key-value store as a ferry-runtime state machine.
//!
//! The state lives in [`SharedState`], behind one lock shared with the API:
//! the API reads it directly (after a read barrier for linearizable reads),
//! and watchers are fed by the apply under the same lock. The runtime owns
//! the write side: it calls [`KvMachine::apply`] for every committed
//! command, in order, on the group's worker.

use std::io;
use std::sync::Arc;
use std::time::Instant;

use ferry_runtime::{
    Command, GroupEvent, RestoreError, SnapshotSource as RuntimeSnapshotSource, StateMachine,
};
use tokio::sync::mpsc;

use crate::error::KvError;
use crate::kv_state::{CommandResponse, KvLimits, KvState, Reads, SnapshotSource};
use crate::state::SharedState;

/// The key-value store's replicated state machine.
pub(crate) struct KvMachine {
    state: Arc<SharedState>,
    limits: KvLimits,
    /// The clock lease deadlines are kept on (shared with the API).
    clock_origin: Instant,
    /// Where events go for the node's own task (config changes, removal).
    events: mpsc::UnboundedSender<GroupEvent>,
    /// Whether this node led the group at the last role change.
    leading: bool,
}

impl KvMachine {
    pub(crate) fn new(
        state: Arc<SharedState>,
        limits: KvLimits,
        clock_origin: Instant,
        events: mpsc::UnboundedSender<GroupEvent>,
    ) -> KvMachine {
        KvMachine {
            state,
            limits,
            clock_origin,
            events,
            leading: false,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock_origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// A consistent view of the key-value state: shared pointers to its
/// versions, encoded on the runtime's blocking thread.
struct KvSnapshot(SnapshotSource);

impl RuntimeSnapshotSource for KvSnapshot {
    fn write_to(&mut self, out: &mut dyn io::Write) -> io::Result<u64> {
        self.0.write_to(|piece| out.write_all(piece))
    }
}

impl StateMachine for KvMachine {
    type Response = Result<CommandResponse, KvError>;
    type Query = ();
    type QueryResponse = ();

    fn apply(&mut self, command: Command<'_>) -> Self::Response {
        let now_ms = self.now_ms();
        // Read results are built only where a client waits for them; on
        // every other member (and on a replay after a restart) they would
        // be thrown away, and a txn of large ranges would cost every member
        // its memory for nothing.
        let reads = if command.answered {
            Reads::Build
        } else {
            Reads::SizeOnly
        };
        let mut state = self.state.lock();
        let applied = state.apply_bytes_with(command.index, command.data, reads);
        state.sync_lease_clock(now_ms);
        applied.response
    }

    fn query(&self, (): ()) {}

    fn snapshot(&self) -> Box<dyn RuntimeSnapshotSource> {
        Box::new(KvSnapshot(self.state.lock().snapshot_source()))
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        // Decoded without the lock (this runs on a blocking thread); only
        // the swap holds it. The replaced state is freed here too.
        let kv = KvState::restore(snapshot, self.limits.clone())
            .map_err(|error| RestoreError::new(error.to_string()))?;
        let replaced = self.state.lock().install(kv);
        drop(replaced);
        Ok(())
    }

    fn on_event(&mut self, event: &GroupEvent) {
        match event {
            GroupEvent::RoleChanged { role, .. } => {
                let leading = *role == ferry_raft::Role::Leader;
                if self.leading && !leading {
                    // Lease deadlines are the leader's; a new leader starts
                    // them afresh.
                    self.state.lock().lease_clock.reset();
                }
                self.leading = leading;
            }
            GroupEvent::Removed | GroupEvent::Halted(_) => {
                // The view says so already: watch streams that wake now end.
                self.state.lock().watches.wake_all();
            }
            GroupEvent::ConfigChanged(_) => {}
        }
        let _ = self.events.send(event.clone());
    }
}
