//! Inline small payloads: the packet v1 sidecar and the tensors' bytes in one frame on a
//! per-peer connection, busy-polled like the engine's tcp transport, answered by one status
//! frame. For hops whose payload is a few KiB (Talker -> Code2Wav codes), where the
//! reservation / grant / write / packet round trips cost more than the bytes: one round trip
//! instead of three, and no wake-up of a parked reader on either side within `spin`.
//!
//! Frame: `u32 BE total`, `u32 BE sidecar length`, sidecar (packet v1 msgpack), then every
//! entry's bytes in entry order. Status: `0` (the receiver has the tensors), or `1`, `u32 BE
//! length`, UTF-8 cause. Frames over [`MAX_INLINE`] are refused.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use omnirig_fixtures::Packet;

use crate::error::{HarnessError, Result};

/// Largest inline frame (sidecar + bytes).
pub const MAX_INLINE: usize = 4 << 20;

fn err(what: &str, e: impl std::fmt::Display) -> HarnessError {
    HarnessError::Control {
        channel: "inline".into(),
        reason: format!("{what}: {e}"),
    }
}

/// `read_exact` that spins (yielding) for up to `spin` before blocking.
fn read_polled(s: &mut TcpStream, buf: &mut [u8], spin: Duration) -> std::io::Result<()> {
    let mut got = 0;
    let until = Instant::now() + spin;
    s.set_nonblocking(true)?;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() < until {
                    std::thread::yield_now();
                } else {
                    s.set_nonblocking(false)?;
                    let r = s.read_exact(&mut buf[got..]);
                    s.set_nonblocking(true)?;
                    return r;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_blocking(s: &mut TcpStream, buf: &[u8]) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.write_all(buf)
}

/// The sending end (one per peer); `send` is synchronous and meant for small frames.
#[derive(Debug)]
pub struct InlineSender {
    stream: Mutex<TcpStream>,
    spin: Duration,
}

impl InlineSender {
    pub fn connect(addr: SocketAddr, spin: Duration) -> Result<Self> {
        let s = TcpStream::connect(addr).map_err(|e| err("connect", e))?;
        s.set_nodelay(true).map_err(|e| err("nodelay", e))?;
        Ok(Self {
            stream: Mutex::new(s),
            spin,
        })
    }

    /// Sends `sidecar` and `parts` (the entries' bytes, in order) and waits for the status.
    pub fn send(&self, sidecar: &[u8], parts: &[&[u8]]) -> Result<()> {
        let body: usize = 4 + sidecar.len() + parts.iter().map(|p| p.len()).sum::<usize>();
        if body > MAX_INLINE {
            return Err(err("send", format!("{body} bytes exceeds {MAX_INLINE}")));
        }
        let mut frame = Vec::with_capacity(4 + body);
        frame.extend_from_slice(&(body as u32).to_be_bytes());
        frame.extend_from_slice(&(sidecar.len() as u32).to_be_bytes());
        frame.extend_from_slice(sidecar);
        for p in parts {
            frame.extend_from_slice(p);
        }
        let mut s = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        write_blocking(&mut s, &frame).map_err(|e| err("write", e))?;
        let mut st = [0u8; 1];
        read_polled(&mut s, &mut st, self.spin).map_err(|e| err("status", e))?;
        if st[0] == 0 {
            return Ok(());
        }
        let mut n = [0u8; 4];
        read_polled(&mut s, &mut n, self.spin).map_err(|e| err("status", e))?;
        let mut cause = vec![0u8; (u32::from_be_bytes(n) as usize).min(1 << 16)];
        read_polled(&mut s, &mut cause, self.spin).map_err(|e| err("status", e))?;
        Err(err("refused", String::from_utf8_lossy(&cause)))
    }
}

/// What the receiving stage does with a frame: land the bytes (`packet`'s entries, in order,
/// concatenated in `bytes`) and check them; `Err` is sent back as the cause.
pub type InlineHandler =
    Arc<dyn Fn(Packet, &[u8]) -> std::result::Result<(), String> + Send + Sync>;

/// The receiving end: a listener; one thread per connection serves frames until it closes.
pub struct InlineReceiver {
    listener: TcpListener,
    spin: Duration,
}

impl InlineReceiver {
    pub fn bind(spin: Duration) -> Result<Self> {
        Ok(Self {
            listener: TcpListener::bind("127.0.0.1:0").map_err(|e| err("bind", e))?,
            spin,
        })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener.local_addr().map_err(|e| err("addr", e))
    }

    /// Serves connections on background threads.
    pub fn serve(self, handler: InlineHandler) {
        std::thread::spawn(move || {
            for conn in self.listener.incoming() {
                let Ok(mut s) = conn else { continue };
                let _ = s.set_nodelay(true);
                let (h, spin) = (handler.clone(), self.spin);
                std::thread::spawn(move || {
                    let _ = serve_conn(&mut s, &h, spin);
                });
            }
        });
    }
}

fn serve_conn(s: &mut TcpStream, h: &InlineHandler, spin: Duration) -> std::io::Result<()> {
    let mut buf = Vec::new();
    loop {
        let mut n = [0u8; 4];
        read_polled(s, &mut n, spin)?;
        let len = u32::from_be_bytes(n) as usize;
        if !(4..=MAX_INLINE).contains(&len) {
            return Err(std::io::Error::other("inline frame length out of range"));
        }
        buf.resize(len, 0);
        read_polled(s, &mut buf, spin)?;
        let side = u32::from_be_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
        let r = match buf.get(4..4 + side) {
            None => Err("sidecar length past the frame".to_string()),
            Some(sc) => Packet::from_msgpack(sc)
                .map_err(|e| format!("packet refused: {e}"))
                .and_then(|p| {
                    let want: u64 = p.entries.iter().map(|e| e.byte_length).sum();
                    let bytes = &buf[4 + side..];
                    if want != bytes.len() as u64 {
                        return Err(format!(
                            "entries say {want} bytes, the frame carries {}",
                            bytes.len()
                        ));
                    }
                    h(p, bytes)
                }),
        };
        match r {
            Ok(()) => write_blocking(s, &[0])?,
            Err(cause) => {
                let mut out = vec![1];
                out.extend_from_slice(&(cause.len() as u32).to_be_bytes());
                out.extend_from_slice(cause.as_bytes());
                write_blocking(s, &out)?;
            }
        }
    }
}
