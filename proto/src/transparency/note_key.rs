//! Signed-note keys as text (`<name>+<8 hex digits of id>+<base64(type ||
//! key)>`), parsed in one place: the log's verifier key (type 0x01,
//! Ed25519), witnesses' (type 0x04, C2SP cosignature/v1) and the witness's
//! private key file.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use ed25519_dalek::VerifyingKey;

/// The signed-note key type of the log's Ed25519 key.
pub const ALG_ED25519: u8 = 0x01;

/// Splits `<name>+<hex id>+<base64>` (the base64 may hold '+'): the name
/// (a valid signed-note key name), the id and the decoded bytes.
pub fn split_key(s: &str) -> Option<(&str, u32, Vec<u8>)> {
    let mut it = s.splitn(3, '+');
    let (name, id, b64) = (it.next()?, it.next()?, it.next()?);
    if !signed_note::is_key_name_valid(name) || id.len() != 8 {
        return None;
    }
    Some((
        name,
        u32::from_str_radix(id, 16).ok()?,
        B64.decode(b64).ok()?,
    ))
}

/// A verifier key of type `alg` with an Ed25519 public key, checked whole:
/// its form, its type, the point, and that its id is the one its name and
/// key give. Returns the name, the id and the key.
pub fn parse_verifier_key(vkey: &str, alg: u8) -> Result<(&str, u32, VerifyingKey), String> {
    let (name, id, raw) =
        split_key(vkey).ok_or("not a signed-note verifier key (<name>+<id>+<key>)")?;
    if raw.len() != 33 || raw[0] != alg {
        return Err(format!("not an Ed25519 key of signed-note type {alg:#04x}"));
    }
    let key = VerifyingKey::from_bytes(raw[1..].try_into().expect("32 bytes"))
        .map_err(|_| "not an Ed25519 point")?;
    if signed_note::key_id(name, &raw) != id {
        return Err("its id does not match its name and key".into());
    }
    Ok((name, id, key))
}
