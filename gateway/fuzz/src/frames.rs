//! Target `frames`: the CBOR messages on the stage channels (host ↔ stage,
//! stage → next stage, feedback, results) and tensor frames.
//!
//! Property: whatever decodes re-encodes to bytes that decode to the same
//! encoding again, and a tensor frame's accessors agree with `validate`.

use proto::frames::{ActivationMessage, FeedbackMessage, HostMessage, StageReply};
use proto::tensor::TensorFrame;
use serde::{de::DeserializeOwned, Serialize};

/// Runs one input: the first byte picks the message type.
pub fn run(data: &[u8]) {
    let Some((which, bytes)) = crate::selector(data) else {
        return;
    };
    match which % 5 {
        0 => {
            roundtrip::<HostMessage>(bytes);
        }
        1 => {
            roundtrip::<StageReply>(bytes);
        }
        2 => {
            if let Some(ActivationMessage::Batch(b)) = roundtrip::<ActivationMessage>(bytes) {
                tensor(&b.hidden);
                tensor(&b.mask);
            }
        }
        3 => {
            roundtrip::<FeedbackMessage>(bytes);
        }
        _ => {
            if let Some(t) = roundtrip::<TensorFrame>(bytes) {
                tensor(&t);
            }
        }
    };
}

fn roundtrip<T: Serialize + DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    let value: T = proto::cbor::from_slice(bytes).ok()?;
    let once = proto::cbor::to_vec(&value);
    let again: T = proto::cbor::from_slice(&once).expect("a re-encoded message decodes");
    assert_eq!(once, proto::cbor::to_vec(&again), "re-encoding is stable");
    Some(value)
}

fn tensor(t: &TensorFrame) {
    let valid = t.validate().is_ok();
    let f32s = t.to_f32();
    let u32s = t.to_u32();
    assert!(valid || (f32s.is_err() && u32s.is_err()));
    if let Ok(v) = f32s.as_ref() {
        assert_eq!(v.len() * 4, t.data.len());
    }
    if let Ok(v) = u32s.as_ref() {
        assert_eq!(v.len() * 4, t.data.len());
    }
}
