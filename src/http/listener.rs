//! Connection limits: the listener accepts a new connection only while fewer than the limit
//! are open, so a flood of idle connections cannot exhaust the server's file descriptors or
//! memory; past the limit, clients wait in the kernel's accept queue. One peer address holds
//! at most [`ConnectionLimits::per_peer`] of them (a connection past it is closed as soon as
//! it is accepted), so one client cannot take every slot. When every slot is taken, the
//! connection that has waited longest without sending a byte (and at least
//! [`SHED_AFTER`]) is closed to make room for the one that arrived: idle connections from
//! many addresses cannot keep a client that has a request to send waiting for their header
//! timeout. (The listener then holds the limit plus the one arrival that waits for a slot.)
//! A connection whose writes make no
//! progress for [`ConnectionLimits::write_timeout`] (a client that does not read its
//! answer) fails its write, so the request ends and gives back what its answer held.

use std::collections::{HashMap, VecDeque};
use std::future::Future as _;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The limits a [`LimitedListener`] holds connections to.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections open at once.
    pub total: usize,
    /// Connections open at once from one peer address.
    pub per_peer: usize,
    /// How long a write may make no progress before the connection fails.
    pub write_timeout: Duration,
}

impl ConnectionLimits {
    /// `total` connections, all of which one peer may hold, writes stalled up to a minute.
    pub fn total(total: usize) -> Self {
        ConnectionLimits {
            total,
            per_peer: total,
            write_timeout: Duration::from_secs(60),
        }
    }
}

/// How long a connection may have sent nothing before, with every slot taken, it is closed
/// for a new arrival. A client with a request sends it as soon as it connects.
pub(crate) const SHED_AFTER: Duration = Duration::from_secs(1);

/// What a connection has sent: nothing yet (and the listener may close it for room), a
/// first byte, or nothing before the listener closed it.
const UNSTARTED: u8 = 0;
const STARTED: u8 = 1;
const SHED: u8 = 2;

/// The state of a connection that may be shed, shared by the connection and the listener.
#[derive(Debug, Default)]
struct Silence {
    state: AtomicU8,
    /// The connection's reader, woken to see that it was shed.
    reader: AtomicWaker,
}

/// Connections that had sent nothing when accepted, oldest first (entries of connections
/// that started or closed since are dropped as they are met).
type Silent = Arc<Mutex<VecDeque<(Instant, Weak<Silence>)>>>;

/// A TCP listener that holds at most [`ConnectionLimits::total`] connections open, at most
/// [`ConnectionLimits::per_peer`] from one address.
#[derive(Debug)]
pub struct LimitedListener {
    inner: TcpListener,
    slots: Arc<Semaphore>,
    peers: Arc<Mutex<HashMap<IpAddr, usize>>>,
    silent: Silent,
    limits: ConnectionLimits,
}

impl LimitedListener {
    /// Wraps a bound listener.
    pub fn new(inner: TcpListener, limits: ConnectionLimits) -> Self {
        LimitedListener {
            inner,
            slots: Arc::new(Semaphore::new(limits.total.max(1))),
            peers: Arc::new(Mutex::new(HashMap::new())),
            silent: Arc::new(Mutex::new(VecDeque::new())),
            limits,
        }
    }

    /// Notes a new connection as silent, dropping notes of connections that started or
    /// closed when they outnumber the connections that can be open.
    fn note_silent(&self) -> Arc<Silence> {
        let silence = Arc::new(Silence::default());
        let mut silent = self.silent.lock().unwrap_or_else(|e| e.into_inner());
        if silent.len() >= self.limits.total.max(1).saturating_mul(2) {
            silent.retain(|(_, s)| {
                s.upgrade()
                    .is_some_and(|s| s.state.load(Ordering::Acquire) == UNSTARTED)
            });
        }
        silent.push_back((Instant::now(), Arc::downgrade(&silence)));
        silence
    }

    /// Closes the connection that has sent nothing for longest, if one has for
    /// [`SHED_AFTER`]. Its slot comes back once it has closed.
    fn shed_oldest_silent(&self) -> bool {
        let mut silent = self.silent.lock().unwrap_or_else(|e| e.into_inner());
        while let Some((since, silence)) = silent.front() {
            let Some(silence) = silence.upgrade() else {
                silent.pop_front();
                continue;
            };
            if silence.state.load(Ordering::Acquire) != UNSTARTED {
                silent.pop_front();
                continue;
            }
            if since.elapsed() < SHED_AFTER {
                return false;
            }
            silent.pop_front();
            if silence
                .state
                .compare_exchange(UNSTARTED, SHED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                silence.reader.wake();
                return true;
            }
        }
        false
    }

    /// Counts a connection from `ip`, unless that address holds its share already.
    fn admit_peer(&self, ip: IpAddr) -> Option<PeerSlot> {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let open = peers.entry(ip).or_insert(0);
        if *open >= self.limits.per_peer.max(1) {
            return None;
        }
        *open += 1;
        Some(PeerSlot {
            peers: self.peers.clone(),
            ip,
        })
    }
}

/// One connection counted against its peer address; uncounted when dropped. The map holds
/// only addresses with connections open, so it is at most as large as the connection limit.
#[derive(Debug)]
struct PeerSlot {
    peers: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(open) = peers.get_mut(&self.ip) {
            *open = open.saturating_sub(1);
            if *open == 0 {
                peers.remove(&self.ip);
            }
        }
    }
}

/// An accepted connection; its slots are given back when it closes.
#[derive(Debug)]
pub struct LimitedStream {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    _peer: PeerSlot,
    /// Set until the connection's first byte arrives.
    silence: Option<Arc<Silence>>,
    write_timeout: Duration,
    /// Armed while a write waits for the client to read.
    write_stall: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl LimitedStream {
    /// Passes a write's result on, failing it once writes made no progress for the write
    /// timeout.
    fn progress<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.write_stall = None;
            return poll;
        }
        let timeout = self.write_timeout;
        let stall = self
            .write_stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if stall.as_mut().poll(cx).is_ready() {
            self.write_stall = None;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing of its answer for {timeout:?}"),
            )));
        }
        Poll::Pending
    }
}

impl axum::serve::Listener for LimitedListener {
    type Io = LimitedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, addr) = match self.inner.accept().await {
                Ok(accepted) => accepted,
                // Out of descriptors and the like: wait a moment rather than spin.
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let slot = loop {
                if let Ok(slot) = self.slots.clone().try_acquire_owned() {
                    break slot;
                }
                if self.shed_oldest_silent() {
                    tracing::debug!("every connection slot taken: closed a silent one");
                }
                // A slot comes back when a connection closes (the shed one among them), and
                // connections too young to shed now may be old enough soon.
                tokio::select! {
                    slot = self.slots.clone().acquire_owned() => if let Ok(slot) = slot {
                        break slot;
                    },
                    () = tokio::time::sleep(SHED_AFTER / 4) => {}
                }
            };
            // A peer past its share (counted once it has a slot): closed at once.
            let Some(peer) = self.admit_peer(addr.ip()) else {
                drop(stream);
                continue;
            };
            let _ = stream.set_nodelay(true);
            return (
                LimitedStream {
                    stream,
                    _slot: slot,
                    _peer: peer,
                    silence: Some(self.note_silent()),
                    write_timeout: self.limits.write_timeout,
                    write_stall: None,
                },
                addr,
            );
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

impl AsyncRead for LimitedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let Some(silence) = self.silence.clone() else {
            return Pin::new(&mut self.stream).poll_read(cx, buf);
        };
        silence.reader.register(cx.waker());
        if silence.state.load(Ordering::Acquire) == SHED {
            // Shed for room before it sent anything: an end of input closes it.
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.stream).poll_read(cx, buf);
        if matches!(poll, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            // If it was shed in the instant between the check and the read, the next read
            // ends it.
            let _ = silence.state.compare_exchange(
                UNSTARTED,
                STARTED,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            if silence.state.load(Ordering::Acquire) == STARTED {
                self.silence = None;
            }
        }
        poll
    }
}

impl AsyncWrite for LimitedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.progress(cx, poll)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.stream).poll_flush(cx);
        self.progress(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.progress(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
