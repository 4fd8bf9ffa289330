//! Snapshots of durable machines, streamed to a follower from a consistent
//! view of the machine's state instead of a file.
//!
//! A durable machine keeps its state on disk itself, so the runtime never
//! writes it out: when a follower needs a snapshot, the machine's view
//! ([`crate::StateMachine::snapshot`]) is written on a blocking thread into
//! a small bounded queue, and cut into the chunks the engine asks for. The
//! last few chunks cut are kept, so that the engine can send them again
//! after a loss; a chunk older than that is answered "gone", and the engine
//! starts the transfer over (from a new view).

use std::collections::BTreeMap;

use bytes::Bytes;
use tokio::sync::mpsc;

use ferry_raft::{GroupId, Index, NodeId};

use crate::machine::SnapshotSource;
use crate::worker::{Completion, Workers};

/// Pieces of the view queued between the thread writing it and the task
/// cutting chunks: the bound on what a transfer holds besides its window.
const PIECES_QUEUED_MAX: usize = 4;
/// Chunks kept for sending again after a loss.
const CHUNKS_KEPT_MAX: usize = 8;

/// A transfer in progress to one follower.
pub(crate) struct Outbound {
    /// The snapshot index the engine names the transfer by.
    pub(crate) index: Index,
    /// Chunk requests: (offset, most bytes).
    requests: mpsc::UnboundedSender<(u64, u64)>,
}

impl Outbound {
    /// Starts streaming `source` for the engine's snapshot `index` to `to`.
    pub(crate) fn start(
        group: GroupId,
        to: NodeId,
        index: Index,
        mut source: Box<dyn SnapshotSource>,
        workers: Workers,
    ) -> Outbound {
        let (pieces_tx, pieces) = mpsc::channel::<Vec<u8>>(PIECES_QUEUED_MAX);
        tokio::task::spawn_blocking(move || {
            struct Pipe(mpsc::Sender<Vec<u8>>);
            impl std::io::Write for Pipe {
                fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                    self.0
                        .blocking_send(buf.to_vec())
                        .map_err(|_| std::io::Error::other("the transfer was abandoned"))?;
                    Ok(buf.len())
                }
                fn flush(&mut self) -> std::io::Result<()> {
                    Ok(())
                }
            }
            if let Err(error) = source.write_to(&mut Pipe(pieces_tx)) {
                tracing::debug!(group, %error, "a streamed snapshot stopped");
            }
        });
        let (requests, requests_rx) = mpsc::unbounded_channel();
        tokio::spawn(cut(group, to, index, pieces, requests_rx, workers));
        Outbound { index, requests }
    }

    /// Asks for the chunk at `offset`; the answer comes as a completion.
    pub(crate) fn request(&self, offset: u64, max_bytes: u64) {
        let _ = self.requests.send((offset, max_bytes));
    }
}

/// Cuts the view's bytes into chunks as the engine asks for them.
async fn cut(
    group: GroupId,
    to: NodeId,
    index: Index,
    mut pieces: mpsc::Receiver<Vec<u8>>,
    mut requests: mpsc::UnboundedReceiver<(u64, u64)>,
    workers: Workers,
) {
    let mut kept: BTreeMap<u64, (Bytes, bool)> = BTreeMap::new();
    let mut pending: Vec<u8> = Vec::new();
    let mut cut_offset: u64 = 0;
    let mut finished = false;
    let mut ended = false;
    while let Some((offset, max_bytes)) = requests.recv().await {
        let chunk = if let Some(chunk) = kept.get(&offset) {
            Some(chunk.clone())
        } else if offset == cut_offset && !finished {
            let want = usize::try_from(max_bytes.max(1)).unwrap_or(usize::MAX);
            // Filled past one chunk (or to the end), so that it is known
            // whether this chunk is the last.
            while pending.len() <= want && !ended {
                match pieces.recv().await {
                    Some(piece) => pending.extend_from_slice(&piece),
                    None => ended = true,
                }
            }
            let take = want.min(pending.len());
            let data = Bytes::from(pending.drain(..take).collect::<Vec<u8>>());
            let last = ended && pending.is_empty();
            finished = last;
            cut_offset = cut_offset.saturating_add(data.len() as u64);
            kept.insert(offset, (data.clone(), last));
            while kept.len() > CHUNKS_KEPT_MAX {
                kept.pop_first();
            }
            Some((data, last))
        } else {
            // Older than what is kept (or beyond the end): the engine
            // starts over.
            None
        };
        workers.complete(
            group,
            Completion::ChunkLoaded {
                to,
                snapshot_index: index,
                offset,
                chunk,
            },
        );
    }
}
