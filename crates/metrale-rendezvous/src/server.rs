//! [`StoreServer`]: a c10d TCPStore server (`proto`), served by rank 0 when
//! no launcher serves a store, and usable by a PyTorch process too.
//!
//! One thread runs an event loop (`event_loop`, on `mio`: decision 0015)
//! over the listener and every connection; the keys and the queries are in
//! `queries`, the reading of queries in `frame`. A connection costs memory
//! (its buffers, counted against [`StoreLimits::memory`]) and a file
//! descriptor, never a thread.
//!
//! Invariants:
//! - The loop thread owns every connection and the store; nothing else
//!   touches them, so there is no lock between queries. Other threads see
//!   [`StoreStats`] (atomics the loop publishes before each write) and
//!   stop the loop through a waker.
//! - The loop never blocks: every socket is non-blocking, and the only
//!   wait is `poll`, bounded by the next check of the deadlines (100 ms).
//! - Dropping the server stops the loop and waits a bounded time for it.
//!
//! Lock order: no lock is shared with the loop (atomics and a waker). The
//! handle's one mutex (`done`) is reached only through `&mut self`
//! (`get_mut`, at stop) and is never locked.

use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use super::RendezvousError;
use super::event_loop;
pub use super::limits::StoreLimits;

/// How long the server keeps a connection with no query.
pub const DEFAULT_IDLE_LIMIT: Duration = Duration::from_secs(600);
/// How long drop waits for the loop to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// The listener's backlog: connections the kernel holds before the loop
/// accepts them (the kernel caps it at `net.core.somaxconn`).
const BACKLOG: libc::c_int = 65535;

/// What the server holds now (for operators and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreStats {
    /// Connections open (those being refused included).
    pub connections: usize,
    /// Connections closed at the connection limit so far (the oldest still
    /// in its handshake, for a new one).
    pub evictions: u64,
    /// Bytes of partial queries and of replies not yet written.
    pub in_flight_bytes: usize,
    /// Bytes of keys and values kept (with their overhead), queued values
    /// included.
    pub store_bytes: usize,
    /// Everything counted against [`StoreLimits::memory`].
    pub memory_bytes: usize,
    /// Keys kept.
    pub keys: usize,
    /// Connections waiting on keys.
    pub waiting: usize,
    /// Queries and connections refused at a limit so far.
    pub refusals: u64,
    /// The connection cap in force (the configured one, or fewer where the
    /// file-descriptor limit allows fewer).
    pub max_connections: usize,
}

/// The loop's published numbers.
#[derive(Debug, Default)]
pub(super) struct StatCells {
    pub(super) connections: AtomicUsize,
    pub(super) evictions: AtomicU64,
    pub(super) in_flight: AtomicUsize,
    pub(super) store_bytes: AtomicUsize,
    pub(super) memory: AtomicUsize,
    pub(super) keys: AtomicUsize,
    pub(super) waiting: AtomicUsize,
    pub(super) refusals: AtomicU64,
    pub(super) max_connections: AtomicUsize,
}

/// What the server's handle shares with its loop.
#[derive(Debug, Default)]
pub(super) struct Shared {
    pub(super) stop: AtomicBool,
    pub(super) stats: StatCells,
}

/// The store server. Dropping it (or [`StoreServer::shutdown`]) stops it
/// within a bounded time.
pub struct StoreServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    token: bool,
    waker: Option<Arc<mio::Waker>>,
    thread: Option<JoinHandle<()>>,
    /// Told when the loop has ended (a mutex only to make the handle `Sync`).
    done: parking_lot::Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field("token", &self.token.then_some("<set>"))
            .finish()
    }
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving with the
    /// default limits; with a `token`, only clients presenting it get past
    /// the handshake.
    pub fn bind(addr: SocketAddr, token: Option<String>) -> Result<StoreServer, RendezvousError> {
        Self::bind_with(addr, token, StoreLimits::default())
    }

    /// As [`StoreServer::bind`], closing connections idle for `idle_limit`.
    pub fn bind_with_idle_limit(
        addr: SocketAddr,
        token: Option<String>,
        idle_limit: Duration,
    ) -> Result<StoreServer, RendezvousError> {
        let limits = StoreLimits {
            idle: idle_limit,
            ..StoreLimits::default()
        };
        Self::bind_with(addr, token, limits)
    }

    /// As [`StoreServer::bind`], with `limits`.
    pub fn bind_with(
        addr: SocketAddr,
        token: Option<String>,
        limits: StoreLimits,
    ) -> Result<StoreServer, RendezvousError> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AddrInUse {
                RendezvousError::AddressInUse {
                    addr,
                    holder: super::client::describe_holder(addr),
                    hint: super::ADDRESS_IN_USE_HINT.to_owned(),
                }
            } else {
                RendezvousError::io(format!("binding the store on {addr}"), e)
            }
        })?;
        // SAFETY: the descriptor is the listening socket `listener` owns,
        // alive for the call; a second listen only changes its backlog.
        let rc = unsafe { libc::listen(listener.as_raw_fd(), BACKLOG) };
        if rc != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "the store's listener keeps its default backlog"
            );
        }
        let local = listener
            .local_addr()
            .map_err(|e| RendezvousError::io("reading the store's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| RendezvousError::io("configuring the store's listener", e))?;
        let mut limits = limits.floored();
        limits.max_connections = limits.max_connections.min(fd_room(limits.max_connections));
        let token = token.filter(|t| !t.is_empty());
        let shared = Arc::new(Shared::default());
        let poll =
            mio::Poll::new().map_err(|e| RendezvousError::io("creating the store's poll", e))?;
        let waker = Arc::new(
            mio::Waker::new(poll.registry(), event_loop::WAKER)
                .map_err(|e| RendezvousError::io("creating the store's waker", e))?,
        );
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let loop_shared = Arc::clone(&shared);
        let loop_token = token.clone();
        let thread = std::thread::Builder::new()
            .name("metrale-store".to_owned())
            .spawn(move || {
                let listener = mio::net::TcpListener::from_std(listener);
                event_loop::run(poll, listener, loop_shared, limits, loop_token);
                let _ = done_tx.send(());
            })
            .map_err(|e| RendezvousError::io("spawning the store's thread", e))?;
        tracing::debug!(addr = %local, "store server listening");
        Ok(StoreServer {
            shared,
            addr: local,
            token: token.is_some(),
            waker: Some(waker),
            thread: Some(thread),
            done: parking_lot::Mutex::new(Some(done_rx)),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the server holds now.
    pub fn stats(&self) -> StoreStats {
        let s = &self.shared.stats;
        StoreStats {
            connections: s.connections.load(Ordering::Acquire),
            evictions: s.evictions.load(Ordering::Acquire),
            in_flight_bytes: s.in_flight.load(Ordering::Acquire),
            store_bytes: s.store_bytes.load(Ordering::Acquire),
            memory_bytes: s.memory.load(Ordering::Acquire),
            keys: s.keys.load(Ordering::Acquire),
            waiting: s.waiting.load(Ordering::Acquire),
            refusals: s.refusals.load(Ordering::Acquire),
            max_connections: s.max_connections.load(Ordering::Acquire),
        }
    }

    /// Stops the server (the same as dropping it).
    pub fn shutdown(self) {
        drop(self);
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(waker) = self.waker.take()
            && let Err(e) = waker.wake()
        {
            tracing::warn!(error = %e, "could not wake the store's loop; it stops at its next tick");
        }
        let finished = self
            .done
            .get_mut()
            .take()
            .is_some_and(|done| done.recv_timeout(SHUTDOWN_GRACE).is_ok());
        let Some(thread) = self.thread.take() else {
            return;
        };
        if !finished {
            tracing::warn!("the store's loop did not stop within its grace; left to end");
        } else if thread.join().is_err() {
            tracing::error!("the store's thread panicked");
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The connections the file-descriptor limit leaves room for, raising the
/// soft limit toward the hard one when `want` needs it.
fn fd_room(want: usize) -> usize {
    // Descriptors the process keeps for everything else.
    const RESERVE: u64 = 256;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a live, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return want;
    }
    let needed = (want as u64).saturating_add(RESERVE);
    if lim.rlim_cur < needed && lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: needed.min(lim.rlim_max),
            rlim_max: lim.rlim_max,
        };
        // SAFETY: `raised` is a live rlimit; raising the soft limit up to
        // the hard one needs no privilege and changes only this process.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            tracing::debug!(
                from = lim.rlim_cur,
                to = raised.rlim_cur,
                "raised the soft fd limit for the store"
            );
            lim.rlim_cur = raised.rlim_cur;
        }
    }
    let room = lim.rlim_cur.saturating_sub(RESERVE).max(1);
    if room < want as u64 {
        tracing::warn!(
            wanted = want,
            room,
            "the store serves fewer connections than its cap: the file-descriptor limit \
             (ulimit -n) leaves room for no more"
        );
    }
    usize::try_from(room).unwrap_or(usize::MAX).min(want)
}
