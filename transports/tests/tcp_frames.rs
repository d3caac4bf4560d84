//! Raw sockets sending malformed frames: the connection is refused with an error frame, and
//! the engine keeps serving everyone else.

mod common;

use std::time::Duration;

use common::*;
use omnirig_transports::transport::tcp::frame::{FrameKind, HEADER_LEN, Header, decode_error_body};
use omnirig_transports::{Access, ErrorKind, Request};
use rstest::rstest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn good_write(len: u64) -> Header {
    Header {
        buffer: 1,
        epoch: 1,
        token: 1,
        offset: 0,
        len,
        ..Header::new(FrameKind::Write, 7)
    }
}

fn mangled(f: impl FnOnce(&mut [u8; HEADER_LEN])) -> Vec<u8> {
    let mut b = good_write(16).encode();
    f(&mut b);
    b.to_vec()
}

/// Reads what the server says before it closes: the error it sent (if any).
async fn reply(s: &mut TcpStream) -> Option<omnirig_transports::Error> {
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut all))
        .await
        .expect("server hung")
        .ok()?;
    if all.len() < HEADER_LEN {
        return None;
    }
    let h = Header::decode(all[..HEADER_LEN].try_into().unwrap(), 0).unwrap();
    assert_eq!(h.kind, FrameKind::Error);
    Some(decode_error_body(
        &all[HEADER_LEN..HEADER_LEN + h.body_len as usize],
    ))
}

#[rstest]
#[case::bad_magic(mangled(|b| b[0] = b'X'))]
#[case::future_version(mangled(|b| b[4] = 9))]
#[case::unknown_kind(mangled(|b| b[5] = 200))]
#[case::reserved_bits(mangled(|b| b[7] = 1))]
#[case::zero_length_write(good_write(0).encode().to_vec())]
#[case::oversize_write(good_write(1 << 40).encode().to_vec())]
#[case::huge_body(Header { body_len: u32::MAX, ..Header::new(FrameKind::Hello, 0) }.encode().to_vec())]
#[case::server_only_kind(Header::new(FrameKind::WriteAck, 0).encode().to_vec())]
#[case::bad_hello(
    [Header { body_len: 3, ..Header::new(FrameKind::Hello, 0) }.encode().to_vec(), b"a b".to_vec()].concat()
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_are_refused_and_others_are_still_served(#[case] bytes: Vec<u8>) {
    let e = engines("tcp", 2).await;
    let (a, b) = (&e[0], &e[1]);
    let mut raw = TcpStream::connect(b.tcp_addr().unwrap()).await.unwrap();
    raw.write_all(&bytes).await.unwrap();
    let err = reply(&mut raw)
        .await
        .expect("an error frame before the close");
    assert_eq!(err.kind(), ErrorKind::Malformed, "{err}");

    // A truncated header followed by a hang-up is just a closed connection.
    let mut raw = TcpStream::connect(b.tcp_addr().unwrap()).await.unwrap();
    raw.write_all(&bytes[..10]).await.unwrap();
    drop(raw);

    let src = a.allocate(1 << 20).unwrap();
    src.write(0, &pattern(4, 1 << 20)).unwrap();
    let dst = b.allocate(1 << 20).unwrap();
    let g = b.grant(&dst, 0, 1 << 20, Access::Write).unwrap();
    a.transfer(
        vec![Request::write(&src, 0, &g, 0, 1 << 20)],
        Some(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    b.revoke(&g);
    let mut got = vec![0u8; 1 << 20];
    dst.read(0, &mut got).unwrap();
    assert!(got == pattern(4, 1 << 20));
}

/// A well-formed write under a grant the server never issued is refused, its payload is
/// drained, and the same connection keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_keeps_the_connection_in_sync() {
    let e = engines("tcp", 1).await;
    let b = &e[0];
    let dst = b.allocate(4096).unwrap();
    dst.write(0, &[CANARY; 4096]).unwrap();
    let g = b.grant(&dst, 0, 4096, Access::Write).unwrap();
    let mut raw = TcpStream::connect(b.tcp_addr().unwrap()).await.unwrap();
    let forged = Header {
        buffer: g.buffer,
        epoch: g.epoch,
        token: g.token ^ 7,
        len: 4096,
        ..Header::new(FrameKind::Write, 1)
    };
    raw.write_all(&forged.encode()).await.unwrap();
    raw.write_all(&[0u8; 4096]).await.unwrap();
    let mut hb = [0u8; HEADER_LEN];
    raw.read_exact(&mut hb).await.unwrap();
    let h = Header::decode(&hb, 0).unwrap();
    assert_eq!((h.kind, h.req_id), (FrameKind::Error, 1));
    let mut body = vec![0u8; h.body_len as usize];
    raw.read_exact(&mut body).await.unwrap();
    assert_eq!(decode_error_body(&body).kind(), ErrorKind::BadToken);

    let honest = Header {
        token: g.token,
        ..forged
    };
    let honest = Header {
        req_id: 2,
        ..honest
    };
    raw.write_all(&honest.encode()).await.unwrap();
    raw.write_all(&[0x42; 4096]).await.unwrap();
    raw.read_exact(&mut hb).await.unwrap();
    assert_eq!(Header::decode(&hb, 0).unwrap().kind, FrameKind::WriteAck);
    b.revoke(&g);
    let mut got = vec![0u8; 4096];
    dst.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 0x42));
}
