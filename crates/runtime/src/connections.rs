//! What accepting connections may cost a node: how many it holds at once,
//! per listener and per source address, how it waits out running out of
//! file descriptors, and how the process's descriptors are split between
//! connections and storage.
//!
//! Every accepted connection takes a file descriptor, and so does every file
//! the storage creates. Twenty thousand idle connections (a few lines of any
//! language) used to take every descriptor the process had, and the next
//! log segment could then not be created: the node stopped. Now the open
//! file limit is raised to its hard limit at start, a reserve of descriptors
//! is kept for the storage and the process ([`split_descriptors`]), the
//! rest is split between the listeners, and each listener holds at most its
//! share ([`ConnectionGate`]): past it, new connections wait in the
//! kernel's backlog, and one source address may hold only part of it.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::log_limit::SharedLogLimiter;

/// How long accepting pauses after the system refused for lack of
/// descriptors or memory: the refused connection stays in the backlog, and
/// retrying at once would spin.
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(100);

/// How many connections that completed the TCP handshake the kernel keeps
/// waiting for a listener to accept them (the kernel caps it at
/// `net.core.somaxconn`). Past the gate's limit connections wait here; a
/// full queue does not refuse new ones but silently drops their final
/// handshake packet, and the client then believes in a connection the
/// server may never see (not even to close it). The default of the
/// standard library and tokio, 128, is smaller than one burst of idle
/// connections; etcd (Go) asks for `somaxconn`.
pub const LISTEN_BACKLOG_CONNECTIONS: u32 = 4096;

/// Binds a listener on `addr` with [`LISTEN_BACKLOG_CONNECTIONS`] (and
/// `SO_REUSEADDR`, as `TcpListener::bind` sets it on Unix).
pub fn bind_listener(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG_CONNECTIONS)
}

/// How many connections one listener holds at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// The most connections at once; more wait in the kernel's backlog.
    pub connections_max: usize,
    /// The most connections at once from one IP address; more are closed
    /// as soon as they are accepted.
    pub connections_per_ip_max: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            connections_max: 1024,
            connections_per_ip_max: 256,
        }
    }
}

/// Counts the connections of one listener against its [`ConnectionLimits`].
#[derive(Debug, Clone)]
pub struct ConnectionGate {
    slots: Arc<Semaphore>,
    per_ip: Arc<Mutex<HashMap<IpAddr, usize>>>,
    limits: ConnectionLimits,
}

/// One admitted connection's place in its [`ConnectionGate`], given back
/// when dropped.
#[derive(Debug)]
pub struct ConnectionTicket {
    _slot: OwnedSemaphorePermit,
    ip: IpAddr,
    per_ip: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl Drop for ConnectionTicket {
    fn drop(&mut self) {
        let mut per_ip = lock(&self.per_ip);
        if let Some(count) = per_ip.get_mut(&self.ip) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                per_ip.remove(&self.ip);
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The counts are updated in one step each; a panic elsewhere while the
    // lock was held cannot leave them half-changed.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ConnectionGate {
    /// A gate with these limits (each at least 1).
    pub fn new(limits: ConnectionLimits) -> ConnectionGate {
        let limits = ConnectionLimits {
            connections_max: limits.connections_max.clamp(1, Semaphore::MAX_PERMITS),
            connections_per_ip_max: limits.connections_per_ip_max.max(1),
        };
        ConnectionGate {
            slots: Arc::new(Semaphore::new(limits.connections_max)),
            per_ip: Arc::new(Mutex::new(HashMap::new())),
            limits,
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> ConnectionLimits {
        self.limits
    }

    /// Connections admitted and not yet closed.
    pub fn open_connections(&self) -> usize {
        self.limits
            .connections_max
            .saturating_sub(self.slots.available_permits())
    }

    /// Waits for a free slot.
    async fn slot(&self) -> OwnedSemaphorePermit {
        match self.slots.clone().acquire_owned().await {
            Ok(slot) => slot,
            // The semaphore is never closed; if it were, waiting forever
            // is what "no slot" means.
            Err(_) => std::future::pending().await,
        }
    }

    /// Admits a connection from `ip` into `slot`, unless that address holds
    /// its share already.
    fn admit(&self, slot: OwnedSemaphorePermit, ip: IpAddr) -> Option<ConnectionTicket> {
        let mut per_ip = lock(&self.per_ip);
        let count = per_ip.entry(ip).or_insert(0);
        if *count >= self.limits.connections_per_ip_max {
            return None;
        }
        *count += 1;
        Some(ConnectionTicket {
            _slot: slot,
            ip,
            per_ip: self.per_ip.clone(),
        })
    }

    /// Accepts the next connection the limits allow. While every slot is
    /// taken this does not accept (connections wait in the kernel's
    /// backlog); a connection from an address that holds its share is
    /// closed at once; running out of descriptors or memory is waited out.
    /// `what` names the listener in the log.
    pub async fn accept(
        &self,
        listener: &TcpListener,
        what: &'static str,
        warnings: &SharedLogLimiter,
    ) -> (TcpStream, SocketAddr, ConnectionTicket) {
        let mut slot = self.slot().await;
        loop {
            let (stream, remote) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    let shortage = is_out_of_resources(&error);
                    if let Some(suppressed) = warnings.allow() {
                        if shortage {
                            tracing::warn!(
                                %error, suppressed,
                                "accepting a {what} connection failed: out of file descriptors or memory; retrying (raise the open files limit or lower the connection limits)"
                            );
                        } else {
                            tracing::debug!(%error, suppressed, "accepting a {what} connection failed");
                        }
                    }
                    if shortage {
                        tokio::time::sleep(ACCEPT_RETRY_DELAY).await;
                    }
                    continue;
                }
            };
            match self.admit(slot, remote.ip()) {
                Some(ticket) => return (stream, remote, ticket),
                None => {
                    if let Some(suppressed) = warnings.allow() {
                        tracing::warn!(
                            %remote, suppressed,
                            limit = self.limits.connections_per_ip_max,
                            "closing a {what} connection: its address holds its share of connections already"
                        );
                    }
                    drop(stream);
                    slot = self.slot().await;
                }
            }
        }
    }
}

/// Whether an accept failed for lack of descriptors or kernel memory
/// (EMFILE, ENFILE, ENOBUFS, ENOMEM), which passes when connections close.
pub fn is_out_of_resources(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// The open files limit of the process, before and after
/// [`raise_open_files_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFilesLimit {
    /// The soft limit found at start.
    pub soft_before: u64,
    /// The soft limit now in force.
    pub soft: u64,
    /// The hard limit (the most the soft limit can be raised to).
    pub hard: u64,
}

/// The soft and hard limits on open files.
fn get_open_files_limit() -> io::Result<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the call to fill.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(limit)
}

/// The soft limit on open files now in force.
pub fn open_files_limit() -> io::Result<u64> {
    // `rlim_t` is a u64 on every system ferry runs on.
    Ok(get_open_files_limit()?.rlim_cur)
}

/// Raises the soft limit on open files to the hard limit, as far as the
/// system allows, so that the node has every descriptor it may have; a
/// process cannot raise it further. Call once at start.
pub fn raise_open_files_limit() -> io::Result<OpenFilesLimit> {
    let limit = get_open_files_limit()?;
    let soft_before = limit.rlim_cur;
    let hard = limit.rlim_max;
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit that the call only reads.
        let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) };
        if rc != 0 {
            // Some systems cap the soft limit below an unlimited hard one;
            // the limit found stays in force, which is still correct.
            return Ok(OpenFilesLimit {
                soft_before,
                soft: soft_before,
                hard,
            });
        }
    }
    Ok(OpenFilesLimit {
        soft_before,
        soft: open_files_limit()?,
        hard,
    })
}

/// How a process's file descriptors are split (see [`split_descriptors`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorSplit {
    /// The most client connections at once.
    pub client_connections_max: usize,
    /// The most inbound peer connections at once.
    pub peer_connections_max: usize,
    /// Why the split is smaller than asked for, if it is.
    pub warning: Option<String>,
}

/// The smallest share a listener gets, even when the limit leaves less: a
/// node that cannot take a few connections cannot work at all.
const LISTENER_CONNECTIONS_MIN: usize = 4;

/// Splits `open_files` descriptors: `reserved_fds` stay free for the
/// storage (log segments, snapshots, directory syncs), outbound peer
/// connections and the process itself; peers get up to `peer_wanted` of
/// the rest (at most half), clients the remainder, or `client_wanted` if
/// that is smaller.
pub fn split_descriptors(
    open_files: u64,
    reserved_fds: u64,
    client_wanted: Option<usize>,
    peer_wanted: usize,
) -> DescriptorSplit {
    let available = usize::try_from(open_files.saturating_sub(reserved_fds)).unwrap_or(usize::MAX);
    let mut warning = None;
    if available < 2 * LISTENER_CONNECTIONS_MIN {
        warning = Some(format!(
            "the open files limit of {open_files} leaves almost nothing beyond the {reserved_fds} \
             descriptors kept for storage; raise it (ulimit -n) or the node may refuse clients"
        ));
    }
    let peer = peer_wanted.min(available / 2).max(LISTENER_CONNECTIONS_MIN);
    let client_room = available.saturating_sub(peer).max(LISTENER_CONNECTIONS_MIN);
    let client = match client_wanted {
        Some(wanted) if wanted > client_room => {
            warning.get_or_insert_with(|| {
                format!(
                    "--max-client-connections {wanted} is more than the open files limit of \
                     {open_files} allows with {reserved_fds} descriptors kept for storage and \
                     {peer} for peers; allowing {client_room} (raise the limit with ulimit -n)"
                )
            });
            client_room
        }
        Some(wanted) => wanted.max(1),
        None => client_room,
    };
    DescriptorSplit {
        client_connections_max: client,
        peer_connections_max: peer,
        warning,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn loopback() -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }

    #[test]
    fn descriptors_are_split_with_a_reserve_kept_for_storage() {
        let split = split_descriptors(256, 64, None, 32);
        assert_eq!(split.peer_connections_max, 32);
        assert_eq!(split.client_connections_max, 160);
        assert_eq!(split.warning, None);
        // Asking for more than the limit allows is capped, and said.
        let split = split_descriptors(256, 64, Some(10_000), 32);
        assert_eq!(split.client_connections_max, 160);
        assert!(split.warning.unwrap().contains("ulimit"));
        assert_eq!(
            split_descriptors(1 << 20, 64, Some(100), 32).client_connections_max,
            100
        );
        // A tiny limit still leaves a few connections, with a warning.
        let split = split_descriptors(32, 64, None, 32);
        assert_eq!(split.peer_connections_max, LISTENER_CONNECTIONS_MIN);
        assert_eq!(split.client_connections_max, LISTENER_CONNECTIONS_MIN);
        assert!(split.warning.is_some());
        // Peers never take more than half of what is left.
        assert_eq!(
            split_descriptors(128, 64, None, 64).peer_connections_max,
            32
        );
    }

    #[tokio::test]
    async fn a_gate_holds_its_total_and_per_address_limits_and_frees_slots_on_close() {
        let listener = TcpListener::bind(loopback()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let gate = ConnectionGate::new(ConnectionLimits {
            connections_max: 3,
            connections_per_ip_max: 2,
        });
        let warnings = SharedLogLimiter::for_remote_input();
        let mut clients = Vec::new();
        for _ in 0..4 {
            clients.push(TcpStream::connect(addr).await.unwrap());
        }
        // Two from 127.0.0.1 are admitted; the third is closed at once.
        let first = gate.accept(&listener, "test", &warnings).await;
        let second = gate.accept(&listener, "test", &warnings).await;
        assert_eq!(gate.open_connections(), 2);
        let accepting = tokio::time::timeout(
            Duration::from_millis(300),
            gate.accept(&listener, "test", &warnings),
        )
        .await;
        assert!(accepting.is_err(), "a third connection from one address");
        let mut closed = 0;
        for client in &mut clients[2..] {
            let mut byte = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_secs(5), client.read(&mut byte)).await;
            if matches!(read, Ok(Ok(0)) | Ok(Err(_))) {
                closed += 1;
            }
        }
        assert!(closed >= 1, "the connection over the share was not closed");
        // Closing one frees its place.
        drop(first);
        assert_eq!(gate.open_connections(), 1);
        let _late = TcpStream::connect(addr).await.unwrap();
        let third = tokio::time::timeout(
            Duration::from_secs(5),
            gate.accept(&listener, "test", &warnings),
        )
        .await
        .expect("a freed slot admits a connection");
        assert_eq!(gate.open_connections(), 2);
        drop((second, third));
        assert_eq!(gate.open_connections(), 0);
        assert!(lock(&gate.per_ip).is_empty());
    }

    #[tokio::test]
    async fn a_full_gate_stops_accepting_until_a_connection_closes() {
        let listener = TcpListener::bind(loopback()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let gate = ConnectionGate::new(ConnectionLimits {
            connections_max: 1,
            connections_per_ip_max: 10,
        });
        let warnings = SharedLogLimiter::for_remote_input();
        let _a = TcpStream::connect(addr).await.unwrap();
        let _b = TcpStream::connect(addr).await.unwrap();
        let held = gate.accept(&listener, "test", &warnings).await;
        let waiting = tokio::time::timeout(
            Duration::from_millis(300),
            gate.accept(&listener, "test", &warnings),
        )
        .await;
        assert!(waiting.is_err(), "accepted past the limit");
        drop(held);
        tokio::time::timeout(
            Duration::from_secs(5),
            gate.accept(&listener, "test", &warnings),
        )
        .await
        .expect("the second connection waited in the backlog");
    }

    /// How many connections wait in the accept queue of the IPv4 listener
    /// on `port` (`rx_queue` of its LISTEN line in `/proc/net/tcp`).
    fn accept_queue_length(port: u16) -> Option<u64> {
        let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
        table.lines().skip(1).find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields.get(1)?.rsplit(':').next()?;
            let listening = *fields.get(3)? == "0A";
            if !listening || u16::from_str_radix(local_port, 16).ok()? != port {
                return None;
            }
            let queues = fields.get(4)?;
            u64::from_str_radix(queues.split(':').nth(1)?, 16).ok()
        })
    }

    /// Regression: listeners were bound with the default backlog of 128.
    /// A burst of idle connections past the gate's limit overflowed it, and
    /// the overflow was not refused: the clients saw connections the server
    /// never accepted and so never closed
    /// (`idle_connections_cannot_take_the_descriptors_the_log_needs` failed
    /// now and then).
    #[tokio::test]
    async fn a_listener_queues_a_burst_of_connections_past_the_default_backlog() {
        const BURST_CONNECTIONS: u64 = 300;
        let somaxconn: u64 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(4096);
        // The kernel holds one more than the backlog, capped by somaxconn.
        let expected = BURST_CONNECTIONS.min(somaxconn + 1);
        let listener = bind_listener(loopback()).unwrap();
        let port = listener.local_addr().unwrap().port();
        // (A full queue drops new handshakes too: bound each connect.)
        let mut connecting = Vec::new();
        for _ in 0..BURST_CONNECTIONS {
            let addr = listener.local_addr().unwrap();
            connecting.push(tokio::spawn(tokio::time::timeout(
                Duration::from_secs(3),
                TcpStream::connect(addr),
            )));
        }
        let mut clients = Vec::new();
        for attempt in connecting {
            if let Ok(Ok(client)) = attempt.await.unwrap() {
                clients.push(client);
            }
        }
        // Nothing is accepted: every connection must be in the queue.
        let mut queued = 0;
        for _ in 0..100 {
            queued = accept_queue_length(port).expect("the listener is in /proc/net/tcp");
            if queued >= expected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            queued, expected,
            "connections past the backlog were dropped"
        );
        assert_eq!(clients.len() as u64, BURST_CONNECTIONS);
    }
}
