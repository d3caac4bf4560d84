//! Control-channel frame bodies (`Msg::decode`). A panic, or a decoded message that fails
//! validation or does not survive a round trip, is a crash AFL saves.

use omnirig_harness::control::Msg;

fn main() {
    afl::fuzz!(|data: &[u8]| {
        if let Ok(m) = Msg::decode(data) {
            m.validate().expect("a decoded message is valid");
            let once = m.encode().expect("a decoded message re-encodes");
            let again = Msg::decode(&once).expect("its encoding decodes");
            // Compare encodings, not values: f64 fields may be NaN.
            assert_eq!(again.encode().expect("re-encodes"), once);
        }
    });
}
