//! A fault-injecting TCP proxy for tests against real services.
//!
//! Put a [`Proxy`] between the code under test and PostgreSQL or RabbitMQ and
//! the test can take the network away at a moment of its choosing:
//! [`Proxy::cut`] drops every live connection, [`Proxy::silence`] keeps them
//! open but forwards nothing more (a network dropping packets, a failover
//! nobody told the client of), [`Proxy::set_refuse`] makes new connections
//! fail, and [`Proxy::set_delay`] adds latency. The service itself
//! stays up, so the test observes exactly what a client sees during a network
//! fault, and recovery once the fault is lifted.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use ferry_testkit::proxy::Proxy;
//! let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap())?;
//! let url = format!("amqp://guest:guest@{}/%2f", proxy.addr());
//! // ... connect through `url`, publish, then:
//! proxy.cut();
//! # Ok(()) }
//! ```

use std::io;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// Bytes read from one side per chunk.
const CHUNK_BYTES: usize = 16 * 1024;
/// Chunks buffered per direction while they wait out the delay; bounds memory.
const CHUNKS_IN_FLIGHT: usize = 64;

/// A TCP proxy on `127.0.0.1:<random port>` forwarding to one upstream address.
///
/// Dropping it stops accepting and closes every connection it carries.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept_task: JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    upstream: SocketAddr,
    refuse: AtomicBool,
    delay_nanos: AtomicU64,
    live: AtomicUsize,
    /// Bumped by every cut; each connection watches it from the moment it is
    /// accepted, so a cut reaches exactly the connections live at that time.
    cuts: watch::Sender<u64>,
    /// Bumped by every silence, watched the same way.
    silences: watch::Sender<u64>,
}

impl Proxy {
    /// Starts a proxy to `upstream`. Must be called within a Tokio runtime;
    /// outside one it returns an error instead of panicking.
    pub fn start(upstream: SocketAddr) -> io::Result<Proxy> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| io::Error::other(format!("Proxy::start needs a Tokio runtime: {e}")))?;
        // A std listener binds synchronously, which keeps `start` a plain
        // function; Tokio takes it over once it is non-blocking.
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let listener = {
            let _guard = runtime.enter();
            TcpListener::from_std(listener)?
        };
        let shared = Arc::new(Shared {
            upstream,
            refuse: AtomicBool::new(false),
            delay_nanos: AtomicU64::new(0),
            live: AtomicUsize::new(0),
            cuts: watch::Sender::new(0),
            silences: watch::Sender::new(0),
        });
        let accept_task = runtime.spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(Proxy {
            addr,
            shared,
            accept_task,
        })
    }

    /// The address clients connect to instead of the upstream.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address the proxy forwards to.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// Resets every live connection, on both sides, at once. New connections
    /// are still accepted and forwarded.
    pub fn cut(&self) {
        self.shared.cuts.send_modify(|generation| *generation += 1);
    }

    /// Silences every live connection: it stays open, and nothing more
    /// passes either way, with no error to either side, until a
    /// [`cut`](Self::cut) resets it. New connections are still accepted and
    /// forwarded.
    pub fn silence(&self) {
        self.shared.silences.send_modify(|generation| *generation += 1);
    }

    /// While `true`, new connections are reset as soon as they are accepted,
    /// so clients see connection failures. Live connections are untouched;
    /// combine with [`cut`](Self::cut) for a full outage.
    pub fn set_refuse(&self, refuse: bool) {
        self.shared.refuse.store(refuse, Ordering::SeqCst);
    }

    /// Holds every chunk read from either side for `delay` before forwarding
    /// it. Chunks are pipelined, so this adds latency without capping
    /// throughput at one chunk per delay. Applies to chunks read after the call.
    pub fn set_delay(&self, delay: Duration) {
        let nanos = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.shared.delay_nanos.store(nanos, Ordering::SeqCst);
    }

    /// Connections currently being forwarded.
    pub fn live_connections(&self) -> usize {
        self.shared.live.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // The accept task owns the listener and the JoinSet of connection
        // tasks; aborting it drops both, which closes every socket.
        self.accept_task.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => {
                    if shared.refuse.load(Ordering::SeqCst) {
                        reset(&client);
                        continue;
                    }
                    let live = LiveGuard::new(&shared);
                    let cut = shared.cuts.subscribe();
                    let silence = shared.silences.subscribe();
                    connections.spawn(serve(client, Arc::clone(&shared), cut, silence, live));
                }
                Err(e) => {
                    // Typically EMFILE; back off instead of spinning, the
                    // condition clears when connections close.
                    tracing::warn!(error = %e, "proxy accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            // Reap finished connections so the set does not grow without bound.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Counts a connection as live until the task serving it ends or is aborted.
struct LiveGuard(Arc<Shared>);

impl LiveGuard {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.live.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(shared))
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Closes with RST rather than FIN: a fault must look like a failure to the
/// peer, never like an orderly shutdown it might treat as a clean end.
fn reset(stream: &TcpStream) {
    // If this fails the socket still closes, just with a FIN.
    let _ = stream.set_zero_linger();
}

/// How a proxied connection's forwarding ended.
enum End {
    /// Both sides closed, or one failed.
    Closed,
    Cut,
    Silenced,
}

async fn serve(
    client: TcpStream,
    shared: Arc<Shared>,
    mut cut: watch::Receiver<u64>,
    mut silence: watch::Receiver<u64>,
    _live: LiveGuard,
) {
    let server = tokio::select! {
        connected = TcpStream::connect(shared.upstream) => connected,
        _ = cut.changed() => {
            reset(&client);
            return;
        }
    };
    let server = match server {
        Ok(server) => server,
        Err(e) => {
            // The client sees the same failure it would see connecting to
            // the upstream directly.
            tracing::debug!(error = %e, upstream = %shared.upstream, "proxy could not reach upstream");
            reset(&client);
            return;
        }
    };
    // Latency matters for the protocols proxied here (small request/response
    // messages); Nagle would add its own delay on top of the injected one.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);

    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let end = {
        let mut up = pin!(pipe(&mut client_read, &mut server_write, &shared));
        let mut down = pin!(pipe(&mut server_read, &mut client_write, &shared));
        let (mut up_done, mut down_done) = (false, false);
        loop {
            tokio::select! {
                result = &mut up, if !up_done => {
                    if result.is_err() {
                        break End::Closed;
                    }
                    up_done = true;
                }
                result = &mut down, if !down_done => {
                    if result.is_err() {
                        break End::Closed;
                    }
                    down_done = true;
                }
                _ = cut.changed() => break End::Cut,
                _ = silence.changed() => break End::Silenced,
            }
            // Each side closing its write half is a normal half-close; the
            // connection is over once both directions have ended.
            if up_done && down_done {
                break End::Closed;
            }
        }
    };
    let was_cut = match end {
        End::Closed => false,
        End::Cut => true,
        // Forwarding has stopped, the sockets stay open: until a cut (or
        // the proxy's end, which aborts this task).
        End::Silenced => cut.changed().await.is_ok(),
    };
    if was_cut {
        reset(client_read.as_ref());
        reset(server_read.as_ref());
    }
}

/// Forwards one direction until the reader reaches EOF, then half-closes the
/// writer. Reading and writing run concurrently so a delay holds each chunk
/// for `delay` after it was read, not after the previous chunk was written.
async fn pipe(from: &mut OwnedReadHalf, to: &mut OwnedWriteHalf, shared: &Shared) -> io::Result<()> {
    let (chunks_tx, mut chunks_rx) = mpsc::channel::<(Instant, Bytes)>(CHUNKS_IN_FLIGHT);
    let read = async move {
        let mut buf = BytesMut::with_capacity(CHUNK_BYTES);
        loop {
            buf.reserve(CHUNK_BYTES);
            if from.read_buf(&mut buf).await? == 0 {
                return Ok::<_, io::Error>(());
            }
            let delay = Duration::from_nanos(shared.delay_nanos.load(Ordering::SeqCst));
            let due = Instant::now() + delay;
            if chunks_tx.send((due, buf.split().freeze())).await.is_err() {
                return Ok(());
            }
        }
    };
    let write = async move {
        while let Some((due, chunk)) = chunks_rx.recv().await {
            if due > Instant::now() {
                tokio::time::sleep_until(due).await;
            }
            to.write_all(&chunk).await?;
        }
        to.shutdown().await
    };
    tokio::try_join!(read, write).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Echoes every byte back until the client closes.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = stream.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    /// Sends `msg` and reads the echo; errors if the connection fails or
    /// closes before the whole echo arrived.
    async fn round_trip(stream: &mut TcpStream, msg: &[u8]) -> io::Result<Vec<u8>> {
        stream.write_all(msg).await?;
        let mut got = vec![0; msg.len()];
        stream.read_exact(&mut got).await?;
        Ok(got)
    }

    async fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !condition() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A connection the proxy dropped either reports EOF or a reset; what it
    /// must never do is deliver data.
    async fn assert_closed(stream: &mut TcpStream) {
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("read on a closed connection must not hang");
        assert!(matches!(read, Ok(0) | Err(_)), "expected EOF or an error, got {read:?}");
    }

    #[tokio::test]
    async fn forwards_bytes_both_ways() {
        let proxy = Proxy::start(echo_server().await).unwrap();
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut client, b"hello").await.unwrap(), b"hello");
        let big: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        assert_eq!(round_trip(&mut client, &big).await.unwrap(), big);
        assert_eq!(proxy.live_connections(), 1);
    }

    #[tokio::test]
    async fn client_half_close_reaches_upstream_and_ends_the_connection() {
        let proxy = Proxy::start(echo_server().await).unwrap();
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        client.write_all(b"bye").await.unwrap();
        client.shutdown().await.unwrap();
        let mut echoed = Vec::new();
        client.read_to_end(&mut echoed).await.unwrap();
        assert_eq!(echoed, b"bye");
        wait_for("the connection to end", || proxy.live_connections() == 0).await;
    }

    #[tokio::test]
    async fn cut_closes_live_connections_and_new_ones_work() {
        let proxy = Proxy::start(echo_server().await).unwrap();
        let mut first = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut second = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut first, b"a").await.unwrap();
        round_trip(&mut second, b"b").await.unwrap();
        assert_eq!(proxy.live_connections(), 2);

        proxy.cut();
        assert_closed(&mut first).await;
        assert_closed(&mut second).await;
        wait_for("cut connections to end", || proxy.live_connections() == 0).await;

        let mut after = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut after, b"again").await.unwrap(), b"again");
        assert_eq!(proxy.live_connections(), 1);
    }

    #[tokio::test]
    async fn silence_keeps_live_connections_open_and_passes_nothing() {
        let proxy = Proxy::start(echo_server().await).unwrap();
        let mut silenced = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut silenced, b"a").await.unwrap();

        proxy.silence();
        // Give the connection's task the silence before writing.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let answer = tokio::time::timeout(Duration::from_millis(300), round_trip(&mut silenced, b"b")).await;
        assert!(answer.is_err(), "nothing passes, and no error: {answer:?}");
        assert_eq!(proxy.live_connections(), 1, "the silenced connection stays open");
        let mut after = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut after, b"c").await.unwrap(), b"c");

        proxy.cut();
        assert_closed(&mut silenced).await;
    }

    #[tokio::test]
    async fn refuse_fails_new_connections_until_lifted() {
        let proxy = Proxy::start(echo_server().await).unwrap();
        let mut before = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut before, b"x").await.unwrap();

        proxy.set_refuse(true);
        // The kernel may complete the handshake before the proxy resets the
        // connection, so the failure can show at connect or at first use.
        if let Ok(mut refused) = TcpStream::connect(proxy.addr()).await {
            let _ = refused.write_all(b"ping").await;
            assert_closed(&mut refused).await;
        }
        // Refusing new connections leaves live ones alone.
        assert_eq!(round_trip(&mut before, b"y").await.unwrap(), b"y");

        proxy.set_refuse(false);
        let mut after = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut after, b"z").await.unwrap(), b"z");
    }

    #[tokio::test]
    async fn delay_is_added_to_each_direction() {
        let proxy = Proxy::start(echo_server().await).unwrap();
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut client, b"warm").await.unwrap();

        let delay = Duration::from_millis(100);
        proxy.set_delay(delay);
        let started = Instant::now();
        round_trip(&mut client, b"slow").await.unwrap();
        // Both the request and the echo pass through the proxy.
        assert!(
            started.elapsed() >= 2 * delay,
            "round trip took {:?}",
            started.elapsed()
        );

        proxy.set_delay(Duration::ZERO);
        round_trip(&mut client, b"fast").await.unwrap();
    }

    #[tokio::test]
    async fn unreachable_upstream_fails_the_client() {
        // Bind then drop to get a port nothing listens on.
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let proxy = Proxy::start(closed).unwrap();
        if let Ok(mut client) = TcpStream::connect(proxy.addr()).await {
            assert_closed(&mut client).await;
        }
        wait_for("the failed connection to end", || proxy.live_connections() == 0).await;
    }

    #[tokio::test]
    async fn drop_closes_connections() {
        let proxy = Proxy::start(echo_server().await).unwrap();
        let addr = proxy.addr();
        let mut client = TcpStream::connect(addr).await.unwrap();
        round_trip(&mut client, b"x").await.unwrap();
        drop(proxy);
        assert_closed(&mut client).await;
        wait_for("the listener to close", || std::net::TcpStream::connect(addr).is_err()).await;
    }

    #[test]
    fn start_outside_a_runtime_is_an_error() {
        let err = Proxy::start("127.0.0.1:1".parse().unwrap()).unwrap_err();
        assert!(err.to_string().contains("Tokio runtime"), "{err}");
    }
}
