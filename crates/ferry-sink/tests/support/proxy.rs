//! A TCP proxy in front of the test broker that can cut every live connection
//! once a given number of bytes went upstream (a connection loss in the middle
//! of a batch), hold back everything the broker sends (confirms that never
//! come), or play a broker's resource alarm (it tells the client
//! `connection.blocked` and reads nothing more from it until it sends
//! `connection.unblocked`), without touching other tests' connections.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::{AbortHandle, JoinHandle};

const DISARMED: u64 = u64::MAX;

struct Shared {
    live: Mutex<Vec<AbortHandle>>,
    upstream_bytes: AtomicU64,
    cut_at: AtomicU64,
    cuts: AtomicUsize,
    /// Connections accepted so far.
    accepted: AtomicUsize,
    cut_done: Notify,
    /// While true, bytes from the broker are held, not forwarded.
    stalled: watch::Sender<bool>,
    /// The alarm's reason while the broker "blocks" its connections.
    alarm: watch::Sender<Option<String>>,
}

impl Shared {
    fn cut_all(&self) {
        self.cut_at.store(DISARMED, Ordering::SeqCst);
        let live = std::mem::take(&mut *self.live.lock().unwrap());
        for task in &live {
            task.abort();
        }
        self.cuts.fetch_add(1, Ordering::SeqCst);
        self.cut_done.notify_waiters();
    }
}

pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(Shared {
            live: Mutex::default(),
            upstream_bytes: AtomicU64::default(),
            cut_at: AtomicU64::new(DISARMED),
            cuts: AtomicUsize::default(),
            accepted: AtomicUsize::default(),
            cut_done: Notify::new(),
            stalled: watch::Sender::new(false),
            alarm: watch::Sender::new(None),
        });
        let accept_shared = Arc::clone(&shared);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                accept_shared.accepted.fetch_add(1, Ordering::SeqCst);
                let shared = Arc::clone(&accept_shared);
                let upstream = upstream.clone();
                let mut live = accept_shared.live.lock().unwrap();
                live.push(tokio::spawn(forward(client, upstream, shared)).abort_handle());
            }
        });
        Self { addr, shared, accept }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts every live connection once `bytes` more have gone upstream; new
    /// connections made after the cut are left alone.
    pub fn cut_after_upstream_bytes(&self, bytes: u64) {
        let now = self.shared.upstream_bytes.load(Ordering::SeqCst);
        self.shared.cut_at.store(now + bytes, Ordering::SeqCst);
    }

    /// Holds (or releases) everything the broker sends on every connection.
    pub fn stall(&self, stalled: bool) {
        self.shared.stalled.send_replace(stalled);
    }

    /// Plays a resource alarm on every open connection: each is sent
    /// `connection.blocked` with `reason` (at a frame boundary, once open),
    /// and nothing more the client sends reaches the broker until
    /// [`unblock`](Self::unblock).
    pub fn block(&self, reason: &str) {
        self.shared.alarm.send_replace(Some(reason.to_owned()));
    }

    /// Ends the alarm: `connection.unblocked`, and what was held goes on.
    pub fn unblock(&self) {
        self.shared.alarm.send_replace(None);
    }

    /// Connections the proxy has accepted since it started.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    pub fn cuts(&self) -> usize {
        self.shared.cuts.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` cuts happened, or `timeout` passed.
    pub async fn wait_for_cuts(&self, n: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.shared.cut_done.notified();
            if self.cuts() >= n {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.cuts() >= n;
            }
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.cut_all();
    }
}

async fn forward(client: TcpStream, upstream: String, shared: Arc<Shared>) {
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up = async {
        let mut buf = vec![0u8; 16 * 1024];
        let mut alarm = shared.alarm.subscribe();
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            // A broker in alarm reads nothing from a blocked connection.
            if alarm.wait_for(Option::is_none).await.is_err() || server_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
            let total = shared.upstream_bytes.fetch_add(n as u64, Ordering::SeqCst) + n as u64;
            if total >= shared.cut_at.load(Ordering::SeqCst) {
                // Aborts this task too, at its next await.
                shared.cut_all();
            }
        }
    };
    // Forwards whole AMQP frames, so that a connection.blocked or
    // connection.unblocked can go between two of them.
    let down = async {
        let mut buf = vec![0u8; 16 * 1024];
        let mut pending: Vec<u8> = Vec::new();
        let mut stalled = shared.stalled.subscribe();
        let mut alarm = shared.alarm.subscribe();
        let mut open = false;
        let mut told: Option<String> = None;
        loop {
            tokio::select! {
                read = server_read.read(&mut buf) => match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => pending.extend_from_slice(&buf[..n]),
                },
                changed = alarm.changed() => if changed.is_err() { return },
            }
            let whole = whole_frames(&pending, &mut open);
            if whole > 0 {
                if stalled.wait_for(|stalled| !stalled).await.is_err()
                    || client_write.write_all(&pending[..whole]).await.is_err()
                {
                    return;
                }
                pending.drain(..whole);
            }
            let wanted = alarm.borrow_and_update().clone();
            if open && wanted != told {
                let frame = match &wanted {
                    Some(reason) => blocked_frame(reason),
                    None => method_frame(&[0, 10, 0, 61]),
                };
                if client_write.write_all(&frame).await.is_err() {
                    return;
                }
                told = wanted;
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// `url` with its host and port replaced by `addr`, and the host:port it had.
pub fn redirect(url: &str, addr: SocketAddr) -> (String, String) {
    let start = url.find("://").expect("a URL with a scheme") + 3;
    let rest = &url[start..];
    let end = rest.find('/').unwrap_or(rest.len());
    let host_start = rest[..end].rfind('@').map_or(0, |at| at + 1);
    let mut upstream = rest[host_start..end].to_owned();
    if !upstream.contains(':') {
        upstream.push_str(":5672");
    }
    let redirected = format!("{}{}{addr}{}", &url[..start], &rest[..host_start], &rest[end..]);
    (redirected, upstream)
}

/// How many bytes of `bytes` are whole frames; sets `open` once the broker
/// has sent connection.open-ok (class 10, method 41).
fn whole_frames(bytes: &[u8], open: &mut bool) -> usize {
    let mut at = 0;
    while bytes.len() >= at + 7 {
        let size = u32::from_be_bytes(bytes[at + 3..at + 7].try_into().unwrap()) as usize;
        let end = at + 7 + size + 1;
        if bytes.len() < end {
            break;
        }
        let payload = &bytes[at + 7..end - 1];
        if bytes[at] == 1 && payload.len() >= 4 && payload[..4] == [0, 10, 0, 41] {
            *open = true;
        }
        at = end;
    }
    at
}

/// A method frame on channel 0 with `payload` (class, method, arguments).
fn method_frame(payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![1, 0, 0];
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    frame.push(0xCE);
    frame
}

/// connection.blocked (class 10, method 60) with its reason.
fn blocked_frame(reason: &str) -> Vec<u8> {
    let mut payload = vec![0, 10, 0, 60, reason.len() as u8];
    payload.extend_from_slice(reason.as_bytes());
    method_frame(&payload)
}
