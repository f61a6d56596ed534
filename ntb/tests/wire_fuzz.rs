//! Property tests: the wire decoders never panic and round-trip what the encoders make.
//!
//! Each property runs `PROPTEST_CASES` cases (default 2500, so about 10^4 in all); CI's short
//! mode sets `PROPTEST_CASES=25000` for 10^5.

use ntb::wire::{self, msg, ErrorReply, Header, FLAG_ERROR, FLAG_REPLY, HEADER_LEN, MAGIC};
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2500)
}

/// Decodes every payload type the fabric and its users parse; must never panic.
fn decode_all(p: &[u8]) {
    let _ = wire::decode_payload::<ErrorReply>(p);
    let _ = wire::decode_payload::<msg::Hello>(p);
    let _ = wire::decode_payload::<msg::WindowAdd>(p);
    let _ = wire::decode_payload::<msg::WindowRemove>(p);
    let _ = wire::decode_payload::<msg::WindowRead>(p);
    let _ = wire::decode_prefix::<msg::WindowWrite>(p);
    let _ = wire::decode_payload::<msg::Doorbell>(p);
    let _ = wire::decode_payload::<msg::SpadWrite>(p);
    let _ = wire::decode_payload::<msg::SpadRead>(p);
    let _ = wire::decode_payload::<u32>(p);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn arbitrary_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Ok(Some((f, used))) = wire::decode_frame(&buf) {
            prop_assert!(used <= buf.len());
            prop_assert_eq!(used, HEADER_LEN + f.payload.len());
            decode_all(&f.payload);
        }
        decode_all(&buf);
    }

    #[test]
    fn arbitrary_headers_with_magic_never_panic(
        rest in proptest::collection::vec(any::<u8>(), 0..64),
        version in prop_oneof![Just(wire::VERSION), any::<u8>()],
    ) {
        let mut buf = MAGIC.to_vec();
        buf.push(version);
        buf.extend_from_slice(&rest);
        if let Ok(h) = Header::decode(&buf) {
            prop_assert!(h.len as usize <= wire::MAX_PAYLOAD);
            prop_assert!(h.fds as usize <= wire::MAX_FDS);
            prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
        let _ = wire::decode_frame(&buf);
    }

    #[test]
    fn frames_roundtrip_and_mutations_never_panic(
        flags in prop_oneof![Just(0u8), Just(FLAG_REPLY), Just(FLAG_REPLY | FLAG_ERROR)],
        opcode in any::<u16>(),
        id in any::<u64>(),
        payload in proptest::collection::vec(any::<u8>(), 0..128),
        fds in 0usize..=wire::MAX_FDS,
        flip in any::<(usize, u8)>(),
        cut in any::<usize>(),
    ) {
        let f = wire::encode_frame(flags, opcode, id, &payload, fds).unwrap();
        let (frame, used) = wire::decode_frame(&f).unwrap().unwrap();
        prop_assert_eq!(used, f.len());
        prop_assert_eq!(frame.header.opcode, opcode);
        prop_assert_eq!(frame.header.id, id);
        prop_assert_eq!(frame.header.fds as usize, fds);
        prop_assert_eq!(&frame.payload, &payload);
        let mut m = f.clone();
        let i = flip.0 % m.len();
        m[i] ^= flip.1 | 1;
        let _ = wire::decode_frame(&m);
        let _ = wire::decode_frame(&f[..cut % (f.len() + 1)]);
    }

    #[test]
    fn typed_payloads_roundtrip(
        code in any::<u32>(),
        message in ".{0,40}",
        id in any::<u32>(),
        size in any::<u64>(),
        label in "[a-z0-9]{0,20}",
        cut in any::<usize>(),
    ) {
        let e = ErrorReply::new(code, message);
        let b = wire::encode_payload(&e).unwrap();
        prop_assert_eq!(wire::decode_payload::<ErrorReply>(&b).unwrap(), e);
        let a = msg::WindowAdd { id, size, fd_offset: size / 2, label };
        let b = wire::encode_payload(&a).unwrap();
        prop_assert_eq!(wire::decode_payload::<msg::WindowAdd>(&b).unwrap(), a);
        decode_all(&b[..cut % (b.len() + 1)]);
    }
}
