//! Sealing tests: RFC 9180 vectors, round trips, tampering, limits, replays.

use super::cipher::HpkeReceiver;
use super::error::SealError;
use super::freshness::{check_fresh, unix_now};
use super::headers::{SealLimits, SealedHeaders};
use super::keys::{request_info, select_key, Aead, KeyConfig, Sealer, ServerKey};
use super::replay::ReplayGuard;
use super::request::{
    open_request, open_request_stream, seal_request, seal_request_stream, seal_request_stream_at,
};
use super::response::{
    open_response, open_response_with_trailer, seal_response, seal_response_with_trailer,
    ResponseOpener, ResponseSealer,
};
use super::response_key::{ClientResponseKey, ResponseKeyMaterial};
use super::{
    CHUNK_OVERHEAD, HEADER_AEAD, HEADER_ENCAPSULATED_KEY, HEADER_KEY_ID, HEADER_SEALED_AT,
    LEN_PREFIX, MAX_REQUEST_AGE_SECS, PAD_BUCKET, REPLAY_WINDOW, RESPONSE_EXPORT_LABEL, TAG_LEN,
};
use aes_gcm::aead::{Aead as _, KeyInit, Payload};
use rand::{rngs::StdRng, SeedableRng};
use std::time::{Duration, Instant};

fn key() -> ServerKey {
    ServerKey::derive(7, b"sealing test key")
}

fn limits() -> SealLimits {
    SealLimits::default()
}

/// A request body of several chunks, with its headers and keys.
fn multi_chunk(aead: Aead, pieces: &[&[u8]]) -> (SealedHeaders, Vec<Vec<u8>>, ClientResponseKey) {
    let (h, mut s, k) = seal_request_stream(&key().config(), aead).unwrap();
    let mut framed = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        framed.push(s.seal(p, i + 1 == pieces.len()).unwrap());
    }
    (h, framed, k)
}

fn open_all(h: &SealedHeaders, body: &[u8]) -> Result<Vec<u8>, SealError> {
    open_request(&key(), h, body).map(|(p, _)| p)
}

#[test]
fn round_trip_both_aeads() {
    for aead in Aead::ALL {
        for msg in [&b""[..], b"x", &vec![0xabu8; 5000]] {
            let (h, body, ck) = seal_request(&key().config(), aead, msg).unwrap();
            assert_eq!(h.aead, aead);
            let (pt, material) = open_request(&key(), &h, &body).unwrap();
            assert_eq!(pt, msg);
            assert_eq!(&material, ck.material());
            let resp = seal_response(&material, b"the answer").unwrap();
            assert_eq!(open_response(&ck, &resp).unwrap(), b"the answer");
        }
    }
}

#[test]
fn response_trailer_is_separate_and_authenticated() {
    for aead in Aead::ALL {
        let (h, body, ck) = seal_request(&key().config(), aead, b"q").unwrap();
        let (_, material) = open_request(&key(), &h, &body).unwrap();
        // Streamed: data chunks, then the trailer; fed byte by byte.
        let mut s = ResponseSealer::new(&material).unwrap();
        let mut wire = s.seal(b"data: a\n\n", false).unwrap();
        wire.extend(s.seal(b"data: [DONE]\n\n", false).unwrap());
        wire.extend(s.finish_with_trailer(b"RECEIPT").unwrap());
        assert!(s.is_finished());
        assert_eq!(s.seal(b"more", true), Err(SealError::Finished));
        let mut o = ResponseOpener::new(&ck, limits());
        let mut data = Vec::new();
        for b in &wire {
            data.extend(o.feed(std::slice::from_ref(b)).unwrap().concat());
        }
        assert_eq!(data, b"data: a\n\ndata: [DONE]\n\n");
        assert_eq!(o.trailer(), Some(&b"RECEIPT"[..]));
        o.finish().unwrap();
        // One-shot helpers agree; open_response drops the trailer.
        let whole = seal_response_with_trailer(&material, b"body", b"R").unwrap();
        assert_eq!(
            open_response_with_trailer(&ck, &whole).unwrap(),
            (b"body".to_vec(), Some(b"R".to_vec()))
        );
        assert_eq!(open_response(&ck, &whole).unwrap(), b"body");
        // A plain final chunk has no trailer.
        let plain = seal_response(&material, b"body").unwrap();
        assert_eq!(open_response_with_trailer(&ck, &plain).unwrap().1, None);
        // Dropping the trailer chunk leaves the body truncated.
        let cut = whole.len() - (LEN_PREFIX + 1 + TAG_LEN);
        assert_eq!(open_response(&ck, &whole[..cut]), Err(SealError::Truncated));
        // A flipped byte in the trailer fails to open.
        let mut bad = whole.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert_eq!(open_response(&ck, &bad), Err(SealError::Open));
    }
}

#[test]
fn requests_never_accept_a_trailer() {
    // A request body cannot end with a trailer chunk: the request opener
    // does not try the trailer AAD.
    let (h, mut sealer, _) = seal_request_stream(&key().config(), Aead::Aes128Gcm).unwrap();
    let mut body = sealer.seal(b"{}", false).unwrap();
    body.extend(sealer.seal_trailer(b"x").unwrap());
    assert_eq!(open_all(&h, &body), Err(SealError::Open));
}

/// `data` as a chunk's plaintext: the marker 0x80, zeros to one bucket.
fn padded(data: &[u8]) -> Vec<u8> {
    let mut p = data.to_vec();
    p.push(0x80);
    p.resize(PAD_BUCKET, 0);
    p
}

#[test]
fn response_nonce_length_is_max_nn_nk() {
    assert_eq!(Aead::Aes128Gcm.response_nonce_len(), 16);
    assert_eq!(Aead::ChaCha20Poly1305.response_nonce_len(), 32);
    for aead in Aead::ALL {
        let (h, body, _) = seal_request(&key().config(), aead, b"q").unwrap();
        let (_, m) = open_request(&key(), &h, &body).unwrap();
        let resp = seal_response(&m, b"").unwrap();
        // nonce ‖ u32 len ‖ one bucket of padding ‖ tag (empty final chunk)
        assert_eq!(
            resp.len(),
            aead.response_nonce_len() + CHUNK_OVERHEAD + PAD_BUCKET
        );
    }
}

#[test]
fn wire_layout_of_request_chunks() {
    let (h, body, _) = seal_request(&key().config(), Aead::Aes128Gcm, b"hello").unwrap();
    // One chunk: "hello", the padding's marker and zeros to a bucket.
    assert_eq!(body.len(), 4 + PAD_BUCKET + TAG_LEN);
    assert_eq!(&body[..4], &(PAD_BUCKET as u32 + 16).to_be_bytes());
    // Built by hand with the HPKE receiver: chunk 0, AAD 0x01.
    let info = request_info(7, Aead::Aes128Gcm, h.sealed_at, Sealer::Client);
    let mut r = HpkeReceiver::setup(&key(), &h.enc, &info, Aead::Aes128Gcm).unwrap();
    assert!(r.open(&body[4..], &[0x00]).unwrap().is_none());
    assert_eq!(
        r.open(&body[4..], &[0x01]).unwrap().unwrap(),
        padded(b"hello")
    );
}

#[test]
fn streaming_one_byte_feeds() {
    for aead in Aead::ALL {
        let mut sk = key();
        sk.key_id = 9;
        let (h, mut s, ck) = seal_request_stream(&sk.config(), aead).unwrap();
        s.set_max_chunk(7);
        let msg: Vec<u8> = (0..100u8).collect();
        let mut body = s.seal(&msg[..50], false).unwrap();
        body.extend(s.seal(&msg[50..], true).unwrap());
        assert!(s.is_finished());
        assert_eq!(s.seal(b"more", true), Err(SealError::Finished));
        let (mut o, m) = open_request_stream(&sk, &h, limits()).unwrap();
        let mut got = Vec::new();
        let mut chunks = 0;
        for b in &body {
            for c in o.feed(std::slice::from_ref(b)).unwrap() {
                chunks += 1;
                got.extend(c);
            }
        }
        // 6 data bytes and the padding's marker per chunk: 2 × ceil(50/6).
        assert_eq!(chunks, 9 + 9);
        assert!(o.is_complete());
        o.finish().unwrap();
        assert_eq!(got, msg);

        // Streamed response, fed one byte at a time.
        let mut rs = ResponseSealer::new(&m).unwrap();
        rs.set_max_chunk(3);
        let mut resp = rs.seal(b"data: a\n\n", false).unwrap();
        resp.extend(rs.seal(b"data: [DONE]\n\n", false).unwrap());
        resp.extend(rs.finish().unwrap());
        let mut ro = ResponseOpener::new(&ck, limits());
        let mut got = Vec::new();
        for b in &resp {
            got.extend(ro.feed(std::slice::from_ref(b)).unwrap().concat());
        }
        assert!(ro.is_complete());
        ro.finish().unwrap();
        assert_eq!(got, b"data: a\n\ndata: [DONE]\n\n");
    }
}

#[test]
fn tampered_chunk_tag_and_length() {
    for aead in Aead::ALL {
        let (h, body, _) = seal_request(&key().config(), aead, b"secret prompt").unwrap();
        // Flip every byte of the body: never accepted.
        for i in 0..body.len() {
            let mut bad = body.clone();
            bad[i] ^= 0x01;
            assert!(open_all(&h, &bad).is_err(), "flip at {i} accepted");
        }
        let mut bad = body.clone();
        bad[4] ^= 0x80; // ciphertext
        assert_eq!(open_all(&h, &bad), Err(SealError::Open));
        let mut bad = body.clone();
        *bad.last_mut().unwrap() ^= 0x01; // tag
        assert_eq!(open_all(&h, &bad), Err(SealError::Open));
        let mut bad = body.clone();
        bad[3] -= 1; // length one shorter: misframed chunk
        assert_eq!(open_all(&h, &bad), Err(SealError::Open));
        let mut bad = body.clone();
        bad[3] += 1; // length one longer: waits for a byte that never comes
        assert_eq!(open_all(&h, &bad), Err(SealError::Truncated));
    }
}

#[test]
fn final_flag_is_authenticated() {
    // A body whose last chunk is not final: truncated.
    let (h, mut s, _) = seal_request_stream(&key().config(), Aead::Aes128Gcm).unwrap();
    let body = s.seal(b"abc", false).unwrap();
    assert_eq!(open_all(&h, &body), Err(SealError::Truncated));
    // A final chunk followed by more chunks: trailing data.
    let (h, mut s, _) = seal_request_stream(&key().config(), Aead::Aes128Gcm).unwrap();
    let mut body = s.seal(b"abc", true).unwrap();
    body.extend(body.clone());
    assert_eq!(open_all(&h, &body), Err(SealError::TrailingData));
    // Bytes after the final chunk.
    let (h, mut body, _) = seal_request(&key().config(), Aead::Aes128Gcm, b"abc").unwrap();
    body.push(0);
    assert_eq!(open_all(&h, &body), Err(SealError::TrailingData));
}

#[test]
fn dropped_reordered_duplicated_truncated() {
    for aead in Aead::ALL {
        let (h, c, _) = multi_chunk(aead, &[b"one", b"two", b"three", b"four"]);
        assert_eq!(open_all(&h, &c.concat()).unwrap(), b"onetwothreefour");
        let dropped = [&c[0][..], &c[2], &c[3]].concat();
        assert_eq!(open_all(&h, &dropped), Err(SealError::Open));
        let reordered = [&c[1][..], &c[0], &c[2], &c[3]].concat();
        assert_eq!(open_all(&h, &reordered), Err(SealError::Open));
        let duplicated = [&c[0][..], &c[1], &c[1], &c[2], &c[3]].concat();
        assert_eq!(open_all(&h, &duplicated), Err(SealError::Open));
        let truncated = [&c[0][..], &c[1], &c[2]].concat();
        assert_eq!(open_all(&h, &truncated), Err(SealError::Truncated));
        let partial = &c.concat()[..c.concat().len() - 1];
        assert_eq!(open_all(&h, partial), Err(SealError::Truncated));
        assert_eq!(open_all(&h, &[]), Err(SealError::Truncated));
    }
}

#[test]
fn opener_is_poisoned_after_error() {
    let (h, mut body, _) = seal_request(&key().config(), Aead::Aes128Gcm, b"abc").unwrap();
    body[5] ^= 1;
    let (mut o, _) = open_request_stream(&key(), &h, limits()).unwrap();
    assert_eq!(o.feed(&body), Err(SealError::Open));
    assert_eq!(o.feed(&[]), Err(SealError::Poisoned));
    assert_eq!(o.finish(), Err(SealError::Poisoned));
}

/// Issue 15: chunks that opened before a later chunk in the same bytes
/// failed are returned (they are authentic); the failure comes from the
/// next call and from `finish`.
#[test]
fn chunks_opened_before_a_failure_are_not_lost() {
    for aead in Aead::ALL {
        let (h, mut c, _) = multi_chunk(aead, &[b"one", b"two", b"three"]);
        c[2][5] ^= 1;
        let (mut o, _) = open_request_stream(&key(), &h, limits()).unwrap();
        assert_eq!(
            o.feed(&c.concat()).unwrap(),
            vec![b"one".to_vec(), b"two".to_vec()]
        );
        assert_eq!(o.feed(&[]), Err(SealError::Open));
        assert_eq!(o.feed(&[]), Err(SealError::Poisoned));
        let (mut o, _) = open_request_stream(&key(), &h, limits()).unwrap();
        assert_eq!(o.feed(&c.concat()).unwrap().len(), 2);
        assert_eq!(o.finish(), Err(SealError::Open));
        // A response opener passes them on the same way.
        let (h, body, k) = seal_request(&key().config(), aead, b"q").unwrap();
        let (_, m) = open_request(&key(), &h, &body).unwrap();
        let mut rs = ResponseSealer::new(&m).unwrap();
        let mut resp = rs.seal(b"data: a\n\n", false).unwrap();
        let mut bad = rs.seal(b"data: b\n\n", false).unwrap();
        *bad.last_mut().unwrap() ^= 1;
        resp.extend(bad);
        let mut ro = ResponseOpener::new(&k, limits());
        assert_eq!(ro.feed(&resp).unwrap().concat(), b"data: a\n\n");
        assert_eq!(ro.feed(&[]), Err(SealError::Open));
        assert_eq!(ro.finish(), Err(SealError::Poisoned));
    }
}

#[test]
fn wrong_key_and_unknown_key_id() {
    let (h, body, _) = seal_request(&key().config(), Aead::ChaCha20Poly1305, b"x").unwrap();
    let other = ServerKey::derive(7, b"another key, same id");
    assert_eq!(
        open_request(&other, &h, &body).map(|_| ()),
        Err(SealError::Open)
    );
    let other_id = ServerKey::derive(8, b"sealing test key");
    assert_eq!(
        open_request(&other_id, &h, &body).map(|_| ()),
        Err(SealError::UnknownKeyId(7))
    );
    let keys = [other_id.clone(), key()];
    assert_eq!(select_key(&keys, &h).unwrap().key_id(), 7);
    assert_eq!(
        select_key(&keys[..1], &h).map(|k| k.key_id()),
        Err(SealError::UnknownKeyId(7))
    );
    // The AEAD is bound in the info: the same enc with the other AEAD fails.
    let mut h2 = h.clone();
    h2.aead = Aead::Aes128Gcm;
    assert!(open_request(&key(), &h2, &body).is_err());
    // So is the key id (a server with key 7 under id 8 cannot open it).
    let mut h3 = h.clone();
    h3.key_id = 8;
    let same_secret_other_id = ServerKey::from_secret_bytes(8, &key().secret_bytes());
    assert_eq!(
        open_request(&same_secret_other_id, &h3, &body).map(|_| ()),
        Err(SealError::Open)
    );
}

#[test]
fn unsupported_aead_in_config() {
    let mut cfg = key().config();
    cfg.aeads = vec![Aead::ChaCha20Poly1305];
    assert_eq!(
        seal_request(&cfg, Aead::Aes128Gcm, b"x").map(|_| ()),
        Err(SealError::UnsupportedAead(1))
    );
    assert_eq!(Aead::from_id(2), Err(SealError::UnsupportedAead(2)));
}

#[test]
fn response_with_another_requests_key_fails() {
    for aead in Aead::ALL {
        let (h1, b1, k1) = seal_request(&key().config(), aead, b"one").unwrap();
        let (_h2, _b2, k2) = seal_request(&key().config(), aead, b"two").unwrap();
        let (_, m1) = open_request(&key(), &h1, &b1).unwrap();
        let resp = seal_response(&m1, b"answer to one").unwrap();
        assert_eq!(open_response(&k2, &resp), Err(SealError::Open));
        // A flipped response-nonce byte changes the keys.
        let mut bad = resp.clone();
        bad[0] ^= 1;
        assert_eq!(open_response(&k1, &bad), Err(SealError::Open));
        assert_eq!(open_response(&k1, &resp).unwrap(), b"answer to one");
        // Too short to hold the nonce.
        assert_eq!(
            open_response(&k1, &resp[..aead.response_nonce_len() - 1]),
            Err(SealError::Truncated)
        );
    }
}

#[test]
fn response_key_schedule_matches_rfc9458_by_hand() {
    let (h, body, ck) = seal_request(&key().config(), Aead::Aes128Gcm, b"q").unwrap();
    let (_, m) = open_request(&key(), &h, &body).unwrap();
    let mut rng = StdRng::seed_from_u64(1);
    let mut rs = ResponseSealer::new_with_rng(&m, &mut rng).unwrap();
    let mut resp = rs.seal(b"first", false).unwrap();
    resp.extend(rs.seal(b"second", true).unwrap());
    // Independent derivation with hkdf + aes-gcm.
    let nonce = &resp[..16];
    let mut salt = h.enc.to_vec();
    salt.extend_from_slice(nonce);
    let hk = hkdf::Hkdf::<sha2::Sha256>::new(Some(&salt), &ck.material().secret);
    let mut k = [0u8; 16];
    let mut n = [0u8; 12];
    hk.expand(b"key", &mut k).unwrap();
    hk.expand(b"nonce", &mut n).unwrap();
    let c = aes_gcm::Aes128Gcm::new_from_slice(&k).unwrap();
    let rest = &resp[16..];
    let l0 = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
    let pt0 = c
        .decrypt(
            (&n).into(),
            Payload {
                msg: &rest[4..4 + l0],
                aad: &[0],
            },
        )
        .unwrap();
    assert_eq!(pt0, padded(b"first"));
    let rest = &rest[4 + l0..];
    let mut n1 = n;
    n1[11] ^= 1;
    let pt1 = c
        .decrypt(
            (&n1).into(),
            Payload {
                msg: &rest[4..],
                aad: &[1],
            },
        )
        .unwrap();
    assert_eq!(pt1, padded(b"second"));
    // And the exported secret is the HPKE export with our label.
    let info = request_info(7, Aead::Aes128Gcm, h.sealed_at, Sealer::Client);
    let r = HpkeReceiver::setup(&key(), &h.enc, &info, Aead::Aes128Gcm).unwrap();
    let mut s = [0u8; 16];
    r.export(RESPONSE_EXPORT_LABEL, &mut s).unwrap();
    assert_eq!(&s[..], &m.secret[..]);
}

#[test]
fn limits_are_enforced() {
    let (h, mut s, _) = seal_request_stream(&key().config(), Aead::Aes128Gcm).unwrap();
    s.set_max_chunk(100);
    let body = s.seal(&[1u8; 100], true).unwrap();
    let small = SealLimits {
        max_chunk: 99,
        max_body: 1 << 20,
    };
    let (mut o, _) = open_request_stream(&key(), &h, small).unwrap();
    // Rejected as soon as the length prefix arrives.
    assert_eq!(
        o.feed(&body[..4]),
        Err(SealError::ChunkTooLarge {
            size: 116,
            limit: 115
        })
    );
    let tight = SealLimits {
        max_chunk: 100,
        max_body: body.len() as u64 - 1,
    };
    let (mut o, _) = open_request_stream(&key(), &h, tight).unwrap();
    assert_eq!(
        o.feed(&body),
        Err(SealError::MessageTooLarge {
            limit: body.len() as u64 - 1
        })
    );
    let exact = SealLimits {
        max_chunk: 100,
        max_body: body.len() as u64,
    };
    let (mut o, _) = open_request_stream(&key(), &h, exact).unwrap();
    assert_eq!(o.feed(&body).unwrap().concat(), vec![1u8; 100]);
    o.finish().unwrap();
    // A length below the tag size cannot be a chunk.
    let (mut o, _) = open_request_stream(&key(), &h, limits()).unwrap();
    assert!(matches!(
        o.feed(&[0, 0, 0, 15]),
        Err(SealError::Malformed(_))
    ));
    // Response limits count the nonce.
    let (h, b, ck) = seal_request(&key().config(), Aead::Aes128Gcm, b"q").unwrap();
    let (_, m) = open_request(&key(), &h, &b).unwrap();
    let resp = seal_response(&m, &[0u8; 64]).unwrap();
    let mut ro = ResponseOpener::new(
        &ck,
        SealLimits {
            max_chunk: 64,
            max_body: resp.len() as u64 - 1,
        },
    );
    assert!(matches!(
        ro.feed(&resp),
        Err(SealError::MessageTooLarge { .. })
    ));
}

#[test]
fn headers_round_trip_and_errors() {
    let (h, _, _) = seal_request(&key().config(), Aead::ChaCha20Poly1305, b"x").unwrap();
    let values = h.to_header_values();
    assert_eq!(values[0], (HEADER_KEY_ID, "7".to_string()));
    assert_eq!(values[1], (HEADER_AEAD, "3".to_string()));
    assert_eq!(values[2].1.len(), 43);
    let lookup = |vals: Vec<(&'static str, String)>| {
        move |name: &'static str| -> Option<String> {
            vals.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.clone())
        }
    };
    let parse = |vals: Vec<(&'static str, String)>| {
        let l = lookup(vals);
        let owned: Vec<(&'static str, Option<String>)> = [
            HEADER_KEY_ID,
            HEADER_AEAD,
            HEADER_ENCAPSULATED_KEY,
            HEADER_SEALED_AT,
        ]
        .iter()
        .map(|n| (*n, l(n)))
        .collect();
        SealedHeaders::from_header_values(|n| {
            owned
                .iter()
                .find(|(k, _)| *k == n)
                .and_then(|(_, v)| v.as_deref())
        })
    };
    assert_eq!(parse(values.to_vec()).unwrap(), h);
    let with = |i: usize, v: &str| {
        let mut vals = values.to_vec();
        vals[i].1 = v.to_string();
        parse(vals)
    };
    assert!(matches!(with(0, "x"), Err(SealError::MalformedHeader(_))));
    assert!(matches!(with(0, "256"), Err(SealError::MalformedHeader(_))));
    assert!(matches!(with(0, "-1"), Err(SealError::MalformedHeader(_))));
    assert!(matches!(with(1, "0x3"), Err(SealError::MalformedHeader(_))));
    assert_eq!(with(1, "2"), Err(SealError::UnsupportedAead(2)));
    assert!(matches!(
        with(2, "a+b/"),
        Err(SealError::MalformedHeader(_))
    ));
    assert_eq!(with(2, "AAAA"), Err(SealError::BadEncapsulatedKey));
    for bad in ["", "-5", "1e9", "18446744073709551616", " 12x"] {
        assert!(
            matches!(with(3, bad), Err(SealError::MalformedHeader(_))),
            "{bad:?}"
        );
    }
    for i in 0..4 {
        let mut missing = values.to_vec();
        missing.remove(i);
        assert!(matches!(parse(missing), Err(SealError::MalformedHeader(_))));
    }
}

#[test]
fn the_sealing_time_is_bound_and_judged_at_the_receivers_clock() {
    let sk = key();
    let now = unix_now();
    let (h, mut s, _) = seal_request_stream_at(
        &sk.config(),
        Aead::Aes128Gcm,
        now - 10,
        &mut rand::rngs::OsRng,
    )
    .unwrap();
    assert_eq!(h.sealed_at, now - 10);
    assert_eq!(
        h.to_header_values()[3],
        (HEADER_SEALED_AT, (now - 10).to_string())
    );
    let body = s.seal(b"{}", true).unwrap();
    assert_eq!(open_request(&sk, &h, &body).unwrap().0, b"{}");
    // The time is bound in the HPKE info: a host that moves it (to make an
    // old request look fresh) gets a body that does not open.
    for moved in [now, now - 11, now + 3600] {
        let relabelled = SealedHeaders {
            sealed_at: moved,
            ..h.clone()
        };
        assert_eq!(
            open_request(&sk, &relabelled, &body).map(|_| ()),
            Err(SealError::Open)
        );
    }
    // Fresh within MAX_REQUEST_AGE_SECS of the receiver's clock, either way.
    let at = |t: u64| SealedHeaders {
        sealed_at: t,
        ..h.clone()
    };
    for ok in [now, now - MAX_REQUEST_AGE_SECS, now + MAX_REQUEST_AGE_SECS] {
        assert_eq!(check_fresh(&at(ok), now), Ok(()));
    }
    for stale in [
        now - MAX_REQUEST_AGE_SECS - 1,
        now + MAX_REQUEST_AGE_SECS + 1,
        0,
    ] {
        assert_eq!(
            check_fresh(&at(stale), now),
            Err(SealError::Stale {
                sealed_at: stale,
                now
            })
        );
    }
    // A request recorded at the first moment it is fresh (now = sealed_at
    // - 300) is still fresh at sealed_at + 300 and up to a second after,
    // rounded down: the guard must still hold it then.
    assert!(REPLAY_WINDOW.as_secs() > 2 * MAX_REQUEST_AGE_SECS + 1);
    // The edge a host would use: delivered at the first second it is fresh
    // (the receiver's clock at sealed_at - 300), recorded then, replayed
    // 600.9 s later, when the clock (rounded down) reads sealed_at + 300 and
    // it is still fresh: the guard must still hold it.
    let sealed = at(now + MAX_REQUEST_AGE_SECS);
    let mut guard = ReplayGuard::new(REPLAY_WINDOW, 4);
    let t0 = Instant::now();
    assert_eq!(check_fresh(&sealed, now), Ok(()));
    guard.check_and_insert(&sealed.enc, t0).unwrap();
    let later = t0 + Duration::from_millis(600_900);
    assert_eq!(check_fresh(&sealed, now + 600), Ok(()));
    assert_eq!(
        guard.check_and_insert(&sealed.enc, later),
        Err(SealError::Replay)
    );
    // A second later it is stale, whatever the guard holds.
    assert!(matches!(
        check_fresh(&sealed, now + 601),
        Err(SealError::Stale { .. })
    ));
}

#[test]
fn low_order_encapsulated_key_is_rejected() {
    let h = SealedHeaders {
        key_id: 7,
        aead: Aead::Aes128Gcm,
        enc: [0u8; 32],
        sealed_at: unix_now(),
    };
    assert_eq!(
        open_request_stream(&key(), &h, limits()).map(|_| ()),
        Err(SealError::BadEncapsulatedKey)
    );
}

#[test]
fn key_config_layout_by_hand() {
    let cfg = KeyConfig {
        key_id: 0x2a,
        public_key: [0x11; 32],
        aeads: vec![Aead::Aes128Gcm, Aead::ChaCha20Poly1305],
    };
    let mut expect = vec![0x2a, 0x00, 0x20];
    expect.extend([0x11; 32]);
    expect.extend([0x00, 0x08, 0x00, 0x01, 0x00, 0x01, 0x00, 0x01, 0x00, 0x03]);
    assert_eq!(cfg.encode(), expect);
    assert_eq!(cfg.encode().len(), 45);
    assert_eq!(KeyConfig::decode(&expect).unwrap(), cfg);

    let other = KeyConfig {
        key_id: 1,
        public_key: [0x22; 32],
        aeads: vec![Aead::ChaCha20Poly1305],
    };
    let list = KeyConfig::encode_list(&[cfg.clone(), other.clone()]);
    assert_eq!(&list[..2], &[0x00, 45]);
    assert_eq!(&list[47..49], &[0x00, 41]);
    assert_eq!(list.len(), 2 + 45 + 2 + 41);
    assert_eq!(
        KeyConfig::decode_list(&list).unwrap(),
        vec![cfg.clone(), other.clone()]
    );

    // Unsupported KEM (P-256, 0x0010) in a list is skipped; alone it is an error.
    let mut p256 = vec![9, 0x00, 0x10];
    p256.extend([0x04; 65]);
    p256.extend([0x00, 0x04, 0x00, 0x01, 0x00, 0x01]);
    assert!(matches!(
        KeyConfig::decode(&p256),
        Err(SealError::UnsupportedKeyConfig(_))
    ));
    let mut mixed = (p256.len() as u16).to_be_bytes().to_vec();
    mixed.extend(&p256);
    mixed.extend(KeyConfig::encode_list(std::slice::from_ref(&other)));
    assert_eq!(KeyConfig::decode_list(&mixed).unwrap(), vec![other.clone()]);

    // Unknown pairs are skipped; AES-256-GCM and HKDF-SHA384 here.
    let mut odd = vec![5, 0x00, 0x20];
    odd.extend([0x33; 32]);
    odd.extend([0x00, 0x0c, 0x00, 0x01, 0x00, 0x02, 0x00, 0x02, 0x00, 0x01]);
    odd.extend([0x00, 0x01, 0x00, 0x03]);
    assert_eq!(
        KeyConfig::decode(&odd).unwrap().aeads,
        vec![Aead::ChaCha20Poly1305]
    );

    // Framing errors.
    for bad in [
        &expect[..expect.len() - 1],
        &expect[..3],
        &[0x2a][..],
        &[&expect[..], &[0]].concat()[..],
    ] {
        assert!(
            matches!(
                KeyConfig::decode(bad),
                Err(SealError::MalformedKeyConfig(_))
            ),
            "{bad:?}"
        );
    }
    let mut zero_algs = expect[..35].to_vec();
    zero_algs.extend([0, 0]);
    assert!(matches!(
        KeyConfig::decode(&zero_algs),
        Err(SealError::MalformedKeyConfig(_))
    ));
    assert!(matches!(
        KeyConfig::decode_list(&list[..list.len() - 1]),
        Err(SealError::MalformedKeyConfig(_))
    ));
    assert!(matches!(
        KeyConfig::decode_list(&[0]),
        Err(SealError::MalformedKeyConfig(_))
    ));
    assert_eq!(KeyConfig::decode_list(&[]).unwrap(), vec![]);
}

#[test]
fn server_key_round_trips_and_debug_redacts() {
    let k = ServerKey::generate(3);
    let k2 = ServerKey::from_secret_bytes(3, &k.secret_bytes());
    assert_eq!(k.public_key(), k2.public_key());
    let dbg = format!("{k:?}");
    assert!(!dbg.contains(&hex::encode(*k.secret_bytes())));
    assert!(dbg.contains("redacted"));
    let cfg = k.config();
    assert_eq!(cfg.key_id, 3);
    assert_eq!(cfg.aeads, Aead::ALL.to_vec());
}

#[test]
fn response_material_serde_and_debug() {
    let (h, body, ck) = seal_request(&key().config(), Aead::Aes128Gcm, b"q").unwrap();
    let (_, m) = open_request(&key(), &h, &body).unwrap();
    let dbg = format!("{m:?} {ck:?}");
    assert!(!dbg.contains(&hex::encode(&m.secret)));
    assert!(dbg.contains("redacted"));
    let bytes = crate::cbor::to_vec(&m);
    let back: ResponseKeyMaterial = crate::cbor::from_slice(&bytes).unwrap();
    assert_eq!(back, m);
    let ck_bytes = crate::cbor::to_vec(&ck);
    assert_eq!(ck_bytes, bytes, "client key serializes like the material");
    let ck2: ClientResponseKey = crate::cbor::from_slice(&ck_bytes).unwrap();
    let resp = seal_response(&back, b"ok").unwrap();
    assert_eq!(open_response(&ck2, &resp).unwrap(), b"ok");
    // Material with a secret of the wrong length is refused.
    let mut short = m.clone();
    short.secret.pop();
    assert!(matches!(
        ResponseSealer::new(&short).map(|_| ()),
        Err(SealError::Malformed(_))
    ));
}

#[test]
fn replay_guard() {
    let t0 = Instant::now();
    let w = Duration::from_secs(60);
    let mut g = ReplayGuard::new(w, 2);
    assert!(g.is_empty());
    g.check_and_insert(&[1; 32], t0).unwrap();
    assert_eq!(g.check_and_insert(&[1; 32], t0), Err(SealError::Replay));
    assert_eq!(
        g.check_and_insert(&[1; 32], t0 + w - Duration::from_millis(1)),
        Err(SealError::Replay)
    );
    g.check_and_insert(&[2; 32], t0 + Duration::from_secs(1))
        .unwrap();
    // Full of entries inside the window: refuse, forget nothing.
    assert_eq!(
        g.check_and_insert(&[3; 32], t0 + Duration::from_secs(2)),
        Err(SealError::ReplayCacheFull)
    );
    // ... and say when there will be room: when [1] leaves the window.
    assert_eq!(
        g.retry_after(t0 + Duration::from_secs(2)),
        w - Duration::from_secs(2)
    );
    assert_eq!(g.len(), 2);
    // After the window the oldest is evicted and room appears.
    g.check_and_insert(&[3; 32], t0 + w).unwrap();
    assert_eq!(g.len(), 2);
    // [1] left the window: it is accepted again (documented limitation).
    assert_eq!(g.check_and_insert(&[2; 32], t0 + w), Err(SealError::Replay));
    // A sealed request's enc is what the guard sees.
    let (h, _, _) = seal_request(&key().config(), Aead::Aes128Gcm, b"x").unwrap();
    let mut g = ReplayGuard::new(w, 10);
    g.check_and_insert(&h.enc, t0).unwrap();
    assert_eq!(g.check_and_insert(&h.enc, t0), Err(SealError::Replay));
}

/// RFC 9180 Appendix A.1.1 (DHKEM(X25519, HKDF-SHA256), HKDF-SHA256,
/// AES-128-GCM, base mode) and A.2.1 (ChaCha20-Poly1305): the receiver
/// wiring derives the published keys, opens the published ciphertexts and
/// reproduces the published exports.
#[test]
fn rfc9180_base_mode_vectors() {
    struct Tv {
        aead: Aead,
        ikm_r: &'static str,
        sk_rm: &'static str,
        pk_rm: &'static str,
        ikm_e: &'static str,
        enc: &'static str,
        ct0: &'static str,
        ct1: &'static str,
        export_empty: &'static str,
        export_test_context: &'static str,
    }
    let tvs = [
        Tv {
            aead: Aead::Aes128Gcm,
            ikm_r: "6db9df30aa07dd42ee5e8181afdb977e538f5e1fec8a06223f33f7013e525037",
            sk_rm: "4612c550263fc8ad58375df3f557aac531d26850903e55a9f23f21d8534e8ac8",
            pk_rm: "3948cfe0ad1ddb695d780e59077195da6c56506b027329794ab02bca80815c4d",
            ikm_e: "7268600d403fce431561aef583ee1613527cff655c1343f29812e66706df3234",
            enc: "37fda3567bdbd628e88668c3c8d7e97d1d1253b6d4ea6d44c150f741f1bf4431",
            ct0: "f938558b5d72f1a23810b4be2ab4f84331acc02fc97babc53a52ae8218a355a96d8770ac83d07bea87e13c512a",
            ct1: "af2d7e9ac9ae7e270f46ba1f975be53c09f8d875bdc8535458c2494e8a6eab251c03d0c22a56b8ca42c2063b84",
            export_empty: "3853fe2b4035195a573ffc53856e77058e15d9ea064de3e59f4961d0095250ee",
            export_test_context: "e9e43065102c3836401bed8c3c3c75ae46be1639869391d62c61f1ec7af54931",
        },
        Tv {
            aead: Aead::ChaCha20Poly1305,
            ikm_r: "1ac01f181fdf9f352797655161c58b75c656a6cc2716dcb66372da835542e1df",
            sk_rm: "8057991eef8f1f1af18f4a9491d16a1ce333f695d4db8e38da75975c4478e0fb",
            pk_rm: "4310ee97d88cc1f088a5576c77ab0cf5c3ac797f3d95139c6c84b5429c59662a",
            ikm_e: "909a9b35d3dc4713a5e72a4da274b55d3d3821a37e5d099e74a647db583a904b",
            enc: "1afa08d3dec047a643885163f1180476fa7ddb54c6a8029ea33f95796bf2ac4a",
            ct0: "1c5250d8034ec2b784ba2cfd69dbdb8af406cfe3ff938e131f0def8c8b60b4db21993c62ce81883d2dd1b51a28",
            ct1: "6b53c051e4199c518de79594e1c4ab18b96f081549d45ce015be002090bb119e85285337cc95ba5f59992dc98c",
            export_empty: "4bbd6243b8bb54cec311fac9df81841b6fd61f56538a775e7c80a9f40160606e",
            export_test_context: "5acb09211139c43b3090489a9da433e8a30ee7188ba8b0a9a1ccf0c229283e53",
        },
    ];
    let info = hex::decode("4f6465206f6e2061204772656369616e2055726e").unwrap();
    let pt = b"Beauty is truth, truth beauty";
    for tv in tvs {
        let k = ServerKey::derive(0, &hex::decode(tv.ikm_r).unwrap());
        assert_eq!(hex::encode(*k.secret_bytes()), tv.sk_rm);
        assert_eq!(hex::encode(k.public_key()), tv.pk_rm);
        // The sender's ephemeral key, derived from ikmE, is the enc.
        let e = ServerKey::derive(0, &hex::decode(tv.ikm_e).unwrap());
        assert_eq!(hex::encode(e.public_key()), tv.enc);
        let enc: [u8; 32] = hex::decode(tv.enc).unwrap().try_into().unwrap();
        let mut r = HpkeReceiver::setup(&k, &enc, &info, tv.aead).unwrap();
        assert_eq!(
            r.open(&hex::decode(tv.ct0).unwrap(), b"Count-0")
                .unwrap()
                .unwrap(),
            pt
        );
        assert_eq!(
            r.open(&hex::decode(tv.ct1).unwrap(), b"Count-1")
                .unwrap()
                .unwrap(),
            pt
        );
        let mut out = [0u8; 32];
        r.export(b"", &mut out).unwrap();
        assert_eq!(hex::encode(out), tv.export_empty);
        r.export(b"TestContext", &mut out).unwrap();
        assert_eq!(hex::encode(out), tv.export_test_context);
    }
}

/// Issue 47: who sealed a request is bound in its HPKE `info`, so a
/// client's request labelled as the host's (or the reverse) does not open.
#[test]
fn the_sealer_is_bound_and_a_relabelled_request_does_not_open() {
    let k = key();
    for sealer in [Sealer::Client, Sealer::Host] {
        let (h, body, _) =
            super::request::seal_request_as(&k.config(), Aead::Aes128Gcm, b"q", sealer).unwrap();
        let (plain, _) = super::request::open_request_as(&k, &h, &body, sealer).unwrap();
        assert_eq!(plain, b"q");
        let other = match sealer {
            Sealer::Client => Sealer::Host,
            Sealer::Host => Sealer::Client,
        };
        assert_eq!(
            super::request::open_request_as(&k, &h, &body, other).unwrap_err(),
            SealError::Open
        );
    }
    // The one-shot helpers seal and open as a client.
    let (h, body, _) = seal_request(&k.config(), Aead::Aes128Gcm, b"q").unwrap();
    assert!(super::request::open_request_as(&k, &h, &body, Sealer::Client).is_ok());
}
