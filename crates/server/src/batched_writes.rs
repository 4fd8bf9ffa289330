//! Responses that are ready together leave in one write.
//!
//! A client connection carries many calls at once (etcd's clients and
//! benchmark multiplex hundreds of requests over a few connections). Each
//! call is answered by its own task; when it finishes it wakes the
//! connection's task, which the scheduler runs next, and which wrote that
//! one answer to the socket at once. So every answer cost a system call of
//! its own (and on the client's side a read), even when a dozen more were
//! finished a moment later: measured, 0.9 `writev` per put.
//!
//! [`BatchedWrites`] sits below the HTTP/2 (or HTTP/1.1) server. It takes
//! what is written into a buffer, and the first flush after it did so only
//! reschedules the connection's task (a wake, then `Pending`): the tasks
//! already queued run first, their answers join the buffer, and the next
//! flush writes all of them with one system call. A flush is never put off
//! twice in a row, so an answer waits at most one turn of the scheduler,
//! and a connection alone on an idle server is written at once on that
//! turn.
//!
//! Bounds: the buffer holds at most [`BATCH_BYTES_MAX`]; a write that would
//! pass it first writes out what is held (waiting, like any write, while
//! the socket is full), and a write of at least [`DIRECT_BYTES_MIN`] to an
//! empty buffer goes to the socket unbuffered, so large answers are not
//! copied. An idle connection keeps no more than [`KEEP_BYTES_MAX`] of
//! buffer.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// The most a connection holds before it writes.
pub const BATCH_BYTES_MAX: usize = 64 * 1024;
/// Writes at least this large skip the buffer when it is empty.
pub const DIRECT_BYTES_MIN: usize = 16 * 1024;
/// The buffer capacity kept between batches; more is given back.
pub const KEEP_BYTES_MAX: usize = 16 * 1024;

/// A connection whose writes are gathered until the flush after next (see
/// the module docs).
#[derive(Debug)]
pub struct BatchedWrites<IO> {
    io: IO,
    /// Bytes taken and not yet written; `buffer[written..]` is what is left.
    buffer: Vec<u8>,
    written: usize,
    /// The last flush was put off: the next one writes.
    flush_deferred: bool,
}

impl<IO> BatchedWrites<IO> {
    /// Wraps a connection.
    pub fn new(io: IO) -> BatchedWrites<IO> {
        BatchedWrites {
            io,
            buffer: Vec::new(),
            written: 0,
            flush_deferred: false,
        }
    }

    /// The connection inside.
    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    fn held_bytes(&self) -> usize {
        self.buffer.len() - self.written
    }
}

impl<IO: AsyncWrite + Unpin> BatchedWrites<IO> {
    /// Writes out everything held; `Pending` while the socket is full.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.buffer.len() {
            let n = match Pin::new(&mut self.io).poll_write(cx, &self.buffer[self.written..]) {
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            };
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.buffer.clear();
        self.written = 0;
        if self.buffer.capacity() > KEEP_BYTES_MAX {
            self.buffer = Vec::new();
        }
        Poll::Ready(Ok(()))
    }

    fn poll_write_slices(
        &mut self,
        cx: &mut Context<'_>,
        slices: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let total_bytes = slices
            .iter()
            .fold(0usize, |sum, s| sum.saturating_add(s.len()));
        if self.held_bytes().saturating_add(total_bytes) > BATCH_BYTES_MAX {
            match self.poll_drain(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            }
        }
        if self.held_bytes() == 0 && total_bytes >= DIRECT_BYTES_MIN {
            return Pin::new(&mut self.io).poll_write_vectored(cx, slices);
        }
        // Here the buffer has room for all of it: it was drained above if
        // not, and what is left is under the direct-write size.
        debug_assert!(self.held_bytes() + total_bytes <= BATCH_BYTES_MAX);
        for slice in slices {
            self.buffer.extend_from_slice(slice);
        }
        Poll::Ready(Ok(total_bytes))
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for BatchedWrites<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .poll_write_slices(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_slices(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        // Slices are copied into one buffer, so many small ones cost no
        // more than one large one.
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.held_bytes() > 0 {
            if !this.flush_deferred {
                // One turn of the scheduler for the answers finishing now
                // to join this write.
                this.flush_deferred = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match this.poll_drain(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            }
        }
        this.flush_deferred = false;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.poll_drain(cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
            Poll::Pending => return Poll::Pending,
        }
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for BatchedWrites<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<IO: Connected> Connected for BatchedWrites<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Waker;

    /// A socket that records what reaches it, takes at most
    /// `bytes_per_write_max` per call and is full (`Pending`) on every
    /// `pending_every`-th call (never when that is 0 or 1).
    #[derive(Default)]
    struct Socket {
        received: Vec<u8>,
        writes: usize,
        calls: usize,
        bytes_per_write_max: usize,
        pending_every: usize,
        flushes: usize,
        shut_down: bool,
    }

    impl AsyncWrite for Socket {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            this.calls += 1;
            if this.pending_every > 1 && this.calls % this.pending_every == 0 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let n = buf.len().min(this.bytes_per_write_max.max(1));
            this.received.extend_from_slice(&buf[..n]);
            this.writes += 1;
            Poll::Ready(Ok(n))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.get_mut().flushes += 1;
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.get_mut().shut_down = true;
            Poll::Ready(Ok(()))
        }
    }

    fn socket() -> Socket {
        Socket {
            bytes_per_write_max: usize::MAX,
            ..Socket::default()
        }
    }

    /// A waker that counts its wakes.
    fn counting_waker() -> (Waker, Arc<AtomicUsize>) {
        struct Count(Arc<AtomicUsize>);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let count = Arc::new(AtomicUsize::new(0));
        (Waker::from(Arc::new(Count(count.clone()))), count)
    }

    fn write(conn: &mut BatchedWrites<Socket>, cx: &mut Context<'_>, bytes: &[u8]) -> usize {
        match Pin::new(conn).poll_write(cx, bytes) {
            Poll::Ready(Ok(n)) => n,
            other => panic!("write: {other:?}"),
        }
    }

    #[test]
    fn answers_written_before_a_flush_leave_in_one_write_on_the_turn_after() {
        let (waker, wakes) = counting_waker();
        let mut cx = Context::from_waker(&waker);
        let mut conn = BatchedWrites::new(socket());
        assert_eq!(write(&mut conn, &mut cx, b"first "), 6);
        // The first flush puts the write off by one turn and says so.
        assert!(Pin::new(&mut conn).poll_flush(&mut cx).is_pending());
        assert_eq!(wakes.load(Ordering::SeqCst), 1);
        assert_eq!(conn.get_ref().writes, 0);
        // Meanwhile another answer is finished.
        assert_eq!(write(&mut conn, &mut cx, b"second"), 6);
        assert!(Pin::new(&mut conn).poll_flush(&mut cx).is_ready());
        assert_eq!(conn.get_ref().writes, 1, "both answers in one write");
        assert_eq!(conn.get_ref().received, b"first second");
        assert_eq!(conn.get_ref().flushes, 1);
        // With nothing held, a flush is passed on at once.
        assert!(Pin::new(&mut conn).poll_flush(&mut cx).is_ready());
        assert_eq!(wakes.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_large_write_to_an_empty_buffer_is_not_copied_and_a_full_buffer_is_written_first() {
        let (waker, _) = counting_waker();
        let mut cx = Context::from_waker(&waker);
        let mut conn = BatchedWrites::new(socket());
        let large = vec![7u8; DIRECT_BYTES_MIN];
        assert_eq!(write(&mut conn, &mut cx, &large), DIRECT_BYTES_MIN);
        assert_eq!(conn.get_ref().writes, 1);
        assert_eq!(conn.held_bytes(), 0);
        // Small writes up to the bound are held; the one that would pass it
        // writes them out first and is then taken.
        let small = vec![1u8; DIRECT_BYTES_MIN - 1];
        let mut held = 0;
        while held + small.len() <= BATCH_BYTES_MAX {
            held += write(&mut conn, &mut cx, &small);
        }
        assert_eq!(conn.get_ref().writes, 1);
        assert_eq!(conn.held_bytes(), held);
        assert_eq!(write(&mut conn, &mut cx, &small), small.len());
        assert_eq!(conn.get_ref().writes, 2);
        assert_eq!(conn.held_bytes(), small.len());
    }

    #[test]
    fn shutdown_writes_out_what_is_held() {
        let (waker, _) = counting_waker();
        let mut cx = Context::from_waker(&waker);
        let mut conn = BatchedWrites::new(socket());
        write(&mut conn, &mut cx, b"last words");
        assert!(Pin::new(&mut conn).poll_shutdown(&mut cx).is_ready());
        assert_eq!(conn.get_ref().received, b"last words");
        assert!(conn.get_ref().shut_down);
    }

    proptest::proptest! {
        /// Whatever the sizes, a socket that takes little at a time and is
        /// sometimes full: every byte arrives once and in order, the
        /// buffer never holds more than its bound, and a flush completes
        /// within a bounded number of turns.
        #[test]
        fn every_byte_arrives_in_order_through_a_slow_socket(
            sizes in proptest::collection::vec(0usize..40_000, 1..40),
            bytes_per_write_max in 1usize..70_000,
            pending_every in 0usize..5,
        ) {
            let (waker, _) = counting_waker();
            let mut cx = Context::from_waker(&waker);
            let mut conn = BatchedWrites::new(Socket {
                bytes_per_write_max,
                pending_every,
                ..Socket::default()
            });
            let mut sent = Vec::new();
            let mut counter = 0u8;
            for size in sizes {
                let chunk: Vec<u8> = (0..size).map(|_| { counter = counter.wrapping_add(1); counter }).collect();
                let mut offset = 0;
                let mut turns = 0;
                while offset < chunk.len() {
                    turns += 1;
                    proptest::prop_assert!(turns < 1_000_000);
                    let halves = [
                        io::IoSlice::new(&chunk[offset..offset + (chunk.len() - offset) / 2]),
                        io::IoSlice::new(&chunk[offset + (chunk.len() - offset) / 2..]),
                    ];
                    if let Poll::Ready(result) = Pin::new(&mut conn).poll_write_vectored(&mut cx, &halves) {
                        let n = result.expect("the socket does not fail");
                        proptest::prop_assert!(n > 0 || chunk.len() == offset);
                        offset += n;
                    }
                    proptest::prop_assert!(conn.held_bytes() <= BATCH_BYTES_MAX);
                }
                sent.extend_from_slice(&chunk);
                let mut turns = 0;
                while Pin::new(&mut conn).poll_flush(&mut cx).is_pending() {
                    turns += 1;
                    proptest::prop_assert!(turns < 1_000_000);
                }
                proptest::prop_assert_eq!(&conn.get_ref().received, &sent);
            }
        }
    }
}
