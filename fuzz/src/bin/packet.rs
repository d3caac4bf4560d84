//! Packet v1, both encodings: the input is tried as msgpack and as JSON. A panic, or a decoded
//! packet that fails validation or does not survive a round trip, is a crash AFL saves.

use omnirig_fixtures::Packet;

fn check(p: Packet) {
    p.validate().expect("a decoded packet is valid");
    let mp = p.to_msgpack().expect("a decoded packet re-encodes");
    assert_eq!(Packet::from_msgpack(&mp).expect("msgpack round trip"), p);
    let js = p
        .to_json_pretty()
        .expect("a decoded packet re-encodes as JSON");
    assert_eq!(
        Packet::from_json(js.as_bytes()).expect("JSON round trip"),
        p
    );
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        if let Ok(p) = Packet::from_msgpack(data) {
            check(p);
        }
        if let Ok(p) = Packet::from_json(data) {
            check(p);
        }
    });
}
