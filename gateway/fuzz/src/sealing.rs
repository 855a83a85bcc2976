//! Target `sealing`: HPKE-sealed request and response bodies and their chunk
//! framing, the sealing headers, and the published key configurations
//! (`application/ohttp-keys`).
//!
//! Properties: a sealed body opens to exactly what was sealed, in whatever
//! pieces it arrives; a body with any byte changed never opens (and no
//! changed plaintext comes out of it); headers and key configurations that
//! parse encode back to what parses the same.

use proto::sealing::{
    open_request_stream, seal_request_stream_at, Aead, ClientResponseKey, KeyConfig,
    ResponseOpener, ResponseSealer, SealLimits, SealedHeaders, ServerKey,
};
use std::sync::OnceLock;

/// The key requests are sealed to.
pub fn server_key() -> &'static ServerKey {
    static KEY: OnceLock<ServerKey> = OnceLock::new();
    KEY.get_or_init(|| ServerKey::derive(1, b"fuzz target sealing"))
}

/// A request sealed to [`server_key`] with a seeded generator: its headers
/// and the key that opens its response.
pub fn sealed_request(
    aead: Aead,
) -> (
    SealedHeaders,
    proto::sealing::ChunkSealer,
    ClientResponseKey,
) {
    // A fixed sealing time keeps the seeds the same from run to run.
    seal_request_stream_at(
        &server_key().config(),
        aead,
        1_800_000_000,
        &mut crate::rng(),
    )
    .expect("the server key supports every AEAD")
}

fn aead(b: u8) -> Aead {
    if b & 1 == 0 {
        Aead::ChaCha20Poly1305
    } else {
        Aead::Aes128Gcm
    }
}

/// Runs one input: the first byte picks the parser or the property.
pub fn run(data: &[u8]) {
    let Some((which, bytes)) = crate::selector(data) else {
        return;
    };
    match which % 5 {
        0 => key_configs(bytes),
        1 => headers(bytes),
        2 => request_body(bytes),
        3 => response_body(bytes),
        _ => tampered(bytes),
    }
}

fn key_configs(bytes: &[u8]) {
    if let Ok(list) = KeyConfig::decode_list(bytes) {
        let again = KeyConfig::decode_list(&KeyConfig::encode_list(&list)).expect("re-encoded");
        assert_eq!(again, list);
    }
    if let Ok(one) = KeyConfig::decode(bytes) {
        assert_eq!(KeyConfig::decode(&one.encode()).expect("re-encoded"), one);
    }
}

fn headers(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    let values: Vec<&str> = text.splitn(4, '\n').collect();
    let names = [
        proto::sealing::HEADER_KEY_ID,
        proto::sealing::HEADER_AEAD,
        proto::sealing::HEADER_ENCAPSULATED_KEY,
        proto::sealing::HEADER_SEALED_AT,
    ];
    let get = |name: &'static str| {
        names
            .iter()
            .position(|n| *n == name)
            .and_then(|i| values.get(i).copied())
    };
    if let Ok(h) = SealedHeaders::from_header_values(get) {
        let shown = h.to_header_values();
        let again = SealedHeaders::from_header_values(|name| {
            shown
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.as_str())
        })
        .expect("re-encoded headers");
        assert_eq!(again, h);
        let _ = open_request_stream(server_key(), &h, SealLimits::default());
    }
}

/// Feeds `body` in pieces of `piece` bytes; returns the plaintext if the
/// body opened completely.
fn feed_all(
    mut feed: impl FnMut(&[u8]) -> Result<Vec<Vec<u8>>, proto::sealing::SealError>,
    body: &[u8],
    piece: usize,
) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    for part in body.chunks(piece.max(1)) {
        out.extend(feed(part).ok()?.concat());
    }
    Some(out)
}

fn request_body(bytes: &[u8]) {
    let Some((&piece, body)) = bytes.split_first() else {
        return;
    };
    let (headers, _, _) = sealed_request(aead(piece));
    let (mut opener, _) =
        open_request_stream(server_key(), &headers, SealLimits::default()).expect("own headers");
    if feed_all(|p| opener.feed(p), body, piece.into()).is_some() {
        let _ = opener.finish();
    }
}

fn response_body(bytes: &[u8]) {
    let Some((&piece, body)) = bytes.split_first() else {
        return;
    };
    let (_, _, key) = sealed_request(aead(piece));
    let mut opener = ResponseOpener::new(&key, SealLimits::default());
    if feed_all(|p| opener.feed(p), body, piece.into()).is_some() {
        let _ = opener.trailer();
        let _ = opener.finish();
    }
}

/// `[flags][chunk size][piece size][flip at: u16 LE][flip mask] plaintext`:
/// seals the plaintext (a request, or a response with or without a
/// trailer), changes one byte when the mask is not zero, and opens it.
fn tampered(bytes: &[u8]) {
    let [flags, chunk, piece, at0, at1, mask, plaintext @ ..] = bytes else {
        return;
    };
    let (headers, mut sealer, client_key) = sealed_request(aead(*flags));
    let limits = SealLimits::default();
    let (opener, material) =
        open_request_stream(server_key(), &headers, limits).expect("own headers");
    let response = flags & 2 != 0;
    let trailer = (response && flags & 4 != 0).then_some(&b"receipt trailer"[..]);
    let mut body = if response {
        let mut s = ResponseSealer::new_with_rng(&material, &mut crate::rng()).expect("sealer");
        s.set_max_chunk((*chunk).into());
        let mut b = s.seal(plaintext, trailer.is_none()).expect("seal");
        if let Some(t) = trailer {
            // A trailer must fit one chunk; the sealer refuses a larger one.
            let Ok(end) = s.finish_with_trailer(t) else {
                assert!(t.len() > usize::from(*chunk).max(1));
                return;
            };
            b.extend(end);
        }
        b
    } else {
        sealer.set_max_chunk((*chunk).into());
        sealer.seal(plaintext, true).expect("seal")
    };
    let at = usize::from(u16::from_le_bytes([*at0, *at1])) % body.len();
    body[at] ^= mask;
    let opened = if response {
        let mut o = ResponseOpener::new(&client_key, limits);
        feed_all(|p| o.feed(p), &body, (*piece).into()).and_then(|out| {
            let got_trailer = o.trailer().map(<[u8]>::to_vec);
            o.finish().ok().map(|()| (out, got_trailer))
        })
    } else {
        let mut o = opener;
        feed_all(|p| o.feed(p), &body, (*piece).into())
            .and_then(|out| o.finish().ok().map(|()| (out, None)))
    };
    match opened {
        Some((out, got_trailer)) => {
            assert_eq!(*mask, 0, "a changed body opened");
            assert_eq!(out, plaintext, "the body opened to other bytes");
            assert_eq!(got_trailer.as_deref(), trailer, "the trailer changed");
        }
        None => assert_ne!(*mask, 0, "an untouched body did not open"),
    }
}
