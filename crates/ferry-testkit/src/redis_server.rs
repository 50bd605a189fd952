//! A `redis-server` of a test's own (from the PATH, or
//! `FERRY_TEST_REDIS_SERVER`), on a free port, without persistence, for
//! tests that need a server configured their way or one to stop.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A redis-server process, ended when dropped.
pub struct RedisServer {
    child: Child,
    port: u16,
    /// Its working directory: a replica writes the copy it is sent there,
    /// and a server loads what it finds there when it starts.
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts one on a free port, with `extra` arguments. Another process
    /// may take the port between the probe and the bind: the server is ours
    /// only if it answers with our child's process id, so a port another
    /// listener holds is given up and another tried.
    pub fn start(extra: &[&str]) -> RedisServer {
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let program = std::env::var("FERRY_TEST_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
            let dir = tempfile::tempdir().unwrap();
            let child = Command::new(program)
                .current_dir(dir.path())
                .args([
                    "--bind",
                    "127.0.0.1",
                    "--port",
                    &port.to_string(),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                // A replica asks for a full copy at once, not after the default 5 s.
                .args(["--repl-diskless-sync-delay", "0"])
                .args(["--dir".as_ref(), dir.path().as_os_str()])
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server (set FERRY_TEST_REDIS_SERVER to its path)");
            let mut server = RedisServer { child, port, _dir: dir };
            if server.answers_as_itself() {
                return server;
            }
            drop(server);
        }
        panic!("no free port for a redis-server in five tries");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn answers_as_itself(&mut self) -> bool {
        let pid = format!("process_id:{}", self.child.id());
        for _ in 0..400 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Some(info) = info_server(self.port) {
                return info.lines().any(|l| l.trim() == pid);
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        false
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `INFO server` over a plain connection: the bulk string's text, or none
/// while the server does not answer (yet).
fn info_server(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream.write_all(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n").ok()?;
    let mut reader = BufReader::new(stream);
    let mut header = String::new();
    reader.read_line(&mut header).ok()?;
    let len: usize = header.trim_end().strip_prefix('$')?.parse().ok()?;
    let mut body = vec![0; len];
    std::io::Read::read_exact(&mut reader, &mut body).ok()?;
    String::from_utf8(body).ok()
}
