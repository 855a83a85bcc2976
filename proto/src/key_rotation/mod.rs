//! HPKE key rotation, in one place: [`KeyRing`] holds the keys a holder
//! accepts (the current one first, replaced ones until they retire, ids
//! from one range) and [`KeySet`] is how the entry stage publishes them,
//! signed with its attested receipt key.
//!
//! Two holders wrap a ring: the entry stage (`enclave-stage/src/keys.rs`:
//! ids 1..=127, or the range the gateway assigns a replica; random ids;
//! a signed key set after every change) and the gateway's own key for
//! clients that trust the host (`gateway/src/service/gateway_key.rs`: ids
//! 0x80..=0xff, the next free id each time). Both rotate on `[keys]
//! rotate_secs` and accept a replaced key `overlap_secs` longer
//! (docs/protocol.md §6.9). The ring is plain data: the holders pass the
//! time in and run the schedule themselves.

mod key_set;
mod ring;

pub use key_set::{KeySet, KEY_SET_CONTENT_TYPE};
pub use ring::{retirement, IdChoice, KeyRing, Retirement};
