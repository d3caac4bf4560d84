//! Inline small payloads: the packet v1 sidecar and the tensors' bytes in one frame on a
//! per-peer connection, busy-polled like the engine's tcp transport, answered by one status
//! frame. For hops whose payload is a few KiB (Talker -> Code2Wav codes), where the
//! reservation / grant / write / packet round trips cost more than the bytes: one round trip
//! instead of three, and no wake-up of a parked reader on either side within `spin`.
//!
//! Frame: `u32 BE total`, `u32 BE sidecar length`, sidecar (packet v1 msgpack), then the
//! packet's bytes in the packet layout ([`packet_layout`]: entry order, each entry at a
//! 64-byte boundary). The sender writes them straight from where they live and the receiver
//! reads them straight into its pool: no copy but the kernel's. Status: `0` (the receiver has
//! the tensors), or `1`, `u32 BE length`, UTF-8 cause. Frames over [`MAX_INLINE`] are refused.

use std::io::{IoSlice, Read, Write};
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

/// Writes `a` then `b`, in as few system calls as the kernel allows.
fn write2_blocking(s: &mut TcpStream, a: &[u8], b: &[u8]) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    let (mut a, mut b) = (a, b);
    while !a.is_empty() || !b.is_empty() {
        let n = match s.write_vectored(&[IoSlice::new(a), IoSlice::new(b)]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}

/// Where each entry of a packet sits in its bytes: entry order, each at a 64-byte boundary.
/// Returns the offsets and the span (the inline frame's payload length; the stage hops'
/// consumers reserve and grant the same layout).
pub fn packet_layout<'a>(lens: impl IntoIterator<Item = &'a u64>) -> (Vec<u64>, u64) {
    let mut at = 0u64;
    let offsets = lens
        .into_iter()
        .map(|len| {
            let o = at;
            at += len.next_multiple_of(64);
            o
        })
        .collect();
    (offsets, at)
}

/// The sending end (one per peer); `send` is synchronous and meant for small frames.
#[derive(Debug)]
pub struct InlineSender {
    /// The connection and the frame buffer, reused so a send allocates nothing.
    stream: Mutex<(TcpStream, Vec<u8>)>,
    spin: Duration,
}

impl InlineSender {
    pub fn connect(addr: SocketAddr, spin: Duration) -> Result<Self> {
        let s = TcpStream::connect(addr).map_err(|e| err("connect", e))?;
        s.set_nodelay(true).map_err(|e| err("nodelay", e))?;
        Ok(Self {
            stream: Mutex::new((s, Vec::new())),
            spin,
        })
    }

    /// Sends `sidecar` and `span` (the packet's bytes in [`packet_layout`]) and waits for
    /// the status.
    pub fn send(&self, sidecar: &[u8], span: &[u8]) -> Result<()> {
        let body: usize = 4 + sidecar.len() + span.len();
        if body > MAX_INLINE {
            return Err(err("send", format!("{body} bytes exceeds {MAX_INLINE}")));
        }
        let mut guard = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let (s, head) = &mut *guard;
        head.clear();
        head.extend_from_slice(&(body as u32).to_be_bytes());
        head.extend_from_slice(&(sidecar.len() as u32).to_be_bytes());
        head.extend_from_slice(sidecar);
        write2_blocking(s, head, span).map_err(|e| err("write", e))?;
        let mut st = [0u8; 1];
        read_polled(s, &mut st, self.spin).map_err(|e| err("status", e))?;
        if st[0] == 0 {
            return Ok(());
        }
        let mut n = [0u8; 4];
        read_polled(s, &mut n, self.spin).map_err(|e| err("status", e))?;
        let mut cause = vec![0u8; (u32::from_be_bytes(n) as usize).min(1 << 16)];
        read_polled(s, &mut cause, self.spin).map_err(|e| err("status", e))?;
        Err(err("refused", String::from_utf8_lossy(&cause)))
    }
}

/// Reads the frame's payload (exactly the span's bytes) into the given slice.
pub type SpanReader<'a> = &'a mut dyn FnMut(&mut [u8]) -> std::io::Result<()>;

/// What the receiving stage does with a frame: given the decoded packet and its span (the
/// payload's length, already checked against the entries), reserve room, read the payload
/// straight into it with the reader (at most once), and check it; `Err` is sent back as the
/// cause (a payload the handler did not read is drained).
pub type InlineHandler =
    Arc<dyn Fn(&Packet, u64, SpanReader<'_>) -> std::result::Result<(), String> + Send + Sync>;

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
    let mut sidecar = Vec::new();
    loop {
        let mut n = [0u8; 8];
        read_polled(s, &mut n, spin)?;
        let len = u32::from_be_bytes(n[..4].try_into().expect("4 bytes")) as usize;
        let side = u32::from_be_bytes(n[4..].try_into().expect("4 bytes")) as usize;
        if !(4..=MAX_INLINE).contains(&len) || side > len - 4 {
            return Err(std::io::Error::other("inline frame lengths out of range"));
        }
        let span = (len - 4 - side) as u64;
        sidecar.resize(side, 0);
        read_polled(s, &mut sidecar, spin)?;
        let mut read = false;
        let r = Packet::from_msgpack(&sidecar)
            .map_err(|e| format!("packet refused: {e}"))
            .and_then(|p| {
                let (_, want) = packet_layout(p.entries.iter().map(|e| &e.byte_length));
                if want != span {
                    return Err(format!(
                        "entries lay out {want} bytes, the frame carries {span}"
                    ));
                }
                let mut reader = |dst: &mut [u8]| {
                    if read || dst.len() as u64 != span {
                        return Err(std::io::Error::other("inline payload read twice or short"));
                    }
                    read = true;
                    read_polled(s, dst, spin)
                };
                h(&p, span, &mut reader)
            });
        if !read {
            // Keep the stream in step: drop the payload nobody took.
            let mut left = span as usize;
            let mut scratch = [0u8; 64 << 10];
            while left > 0 {
                let k = left.min(scratch.len());
                read_polled(s, &mut scratch[..k], spin)?;
                left -= k;
            }
        }
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
