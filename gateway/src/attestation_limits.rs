//! Bounds on `GET /v1/attestation`, which is open to anyone who can reach
//! the gateway and makes every stage produce fresh evidence (on Nitro, a
//! call to the Nitro Security Module each):
//!
//! - **a short cache per nonce**: evidence made for a nonce is served again
//!   for the same nonce (and the same pipeline connection) for
//!   `attestation_cache_secs`; concurrent calls for one nonce share one
//!   round to the stages. A client that sends its own fresh nonce still gets
//!   documents made for it, so freshness is not weakened;
//! - **a per-client rate**: calls that need fresh evidence are counted per
//!   client (an IPv4 address, or an IPv6 /64, what one subscriber usually
//!   holds) in one-minute windows (`attestation_per_minute`); past it the
//!   answer is 429 with `Retry-After`;
//! - **a global rate**: at most [`FRESH_PER_SECOND`] calls that need fresh
//!   evidence per second from all clients together, so many addresses
//!   cannot add up to unbounded work for the stages.
//!
//! Both maps are bounded: expired entries are dropped as new ones arrive;
//! past [`MAX_ENTRIES`] a call is served uncached (the cache), and a client
//! with no window kept is refused (the rate: it fails closed, never open).

use proto::bundle::EvidenceBundle;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::OnceCell;

/// Most cached nonces, and most client windows, kept at once.
pub const MAX_ENTRIES: usize = 4096;
const WINDOW: Duration = Duration::from_secs(60);
/// Most calls that need fresh evidence per second, all clients together.
pub const FRESH_PER_SECOND: u32 = 50;

/// Evidence for one nonce, made once and shared.
pub type SharedBundle = Arc<OnceCell<Arc<EvidenceBundle>>>;

/// What a cached bundle is for: model, pipeline connection (a reconnect
/// brings new stage keys), nonce.
type CacheKey = (String, u64, Vec<u8>);

/// The limiter and cache.
pub struct AttestationLimits {
    per_minute: u32,
    ttl: Duration,
    windows: Mutex<HashMap<IpAddr, (Instant, u32)>>,
    /// The current one-second window of all clients' calls.
    global: Mutex<(Instant, u32)>,
    cache: Mutex<HashMap<CacheKey, (Instant, SharedBundle)>>,
}

/// Whom a call is counted against: an IPv4 address, or the /64 of an IPv6
/// one (IPv4-mapped IPv6 addresses count as their IPv4 address).
fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(prefix.into())
            }
        },
        v4 => v4,
    }
}

impl AttestationLimits {
    /// `per_minute` fresh-evidence calls per client address; evidence kept
    /// `ttl` per nonce (zero: not kept).
    pub fn new(per_minute: u32, ttl: Duration) -> Self {
        Self {
            per_minute,
            ttl,
            windows: Mutex::new(HashMap::new()),
            global: Mutex::new((Instant::now(), 0)),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Counts one call that needs fresh evidence from `client`; `Err` with
    /// the seconds until its window ends when it is over the rate.
    pub fn admit(&self, client: Option<IpAddr>) -> Result<(), u64> {
        let now = Instant::now();
        {
            let mut g = self.global.lock().unwrap();
            if now.duration_since(g.0) >= Duration::from_secs(1) {
                *g = (now, 0);
            }
            if g.1 >= FRESH_PER_SECOND {
                return Err(1);
            }
            g.1 += 1;
        }
        let Some(ip) = client.map(client_key) else {
            return Ok(());
        };
        let mut w = self.windows.lock().unwrap();
        if w.len() >= MAX_ENTRIES && !w.contains_key(&ip) {
            w.retain(|_, (start, _)| now.duration_since(*start) < WINDOW);
            if w.len() >= MAX_ENTRIES {
                // Full of live windows: refuse until the oldest ends.
                let oldest = w.values().map(|(start, _)| *start).min().unwrap_or(now);
                let left = WINDOW.saturating_sub(now.duration_since(oldest));
                return Err(left.as_secs().max(1));
            }
        }
        let (start, count) = w.entry(ip).or_insert((now, 0));
        if now.duration_since(*start) >= WINDOW {
            *start = now;
            *count = 0;
        }
        if *count >= self.per_minute {
            let left = WINDOW.saturating_sub(now.duration_since(*start));
            return Err(left.as_secs().max(1));
        }
        *count += 1;
        Ok(())
    }

    /// The shared evidence slot for `nonce` on pipeline `model` at
    /// connection `epoch`: the cached one while it is young, else a new one
    /// (kept when the cache is on and has room).
    pub fn slot(&self, model: &str, epoch: u64, nonce: &[u8]) -> SharedBundle {
        if self.ttl.is_zero() {
            return Arc::default();
        }
        let now = Instant::now();
        let key = (model.to_string(), epoch, nonce.to_vec());
        let mut c = self.cache.lock().unwrap();
        if let Some((at, slot)) = c.get(&key) {
            if now.duration_since(*at) < self.ttl {
                return slot.clone();
            }
        }
        if c.len() >= MAX_ENTRIES {
            c.retain(|_, (at, _)| now.duration_since(*at) < self.ttl);
            if c.len() >= MAX_ENTRIES {
                return Arc::default();
            }
        }
        let slot = SharedBundle::default();
        c.insert(key, (now, slot.clone()));
        slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_is_per_client_and_per_window() {
        let l = AttestationLimits::new(2, Duration::from_secs(10));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        assert_eq!(l.admit(Some(a)), Ok(()));
        assert_eq!(l.admit(Some(a)), Ok(()));
        let retry = l.admit(Some(a)).unwrap_err();
        assert!((1..=60).contains(&retry), "{retry}");
        assert_eq!(l.admit(Some(b)), Ok(()));
        // Expired windows make room for new clients.
        l.windows
            .lock()
            .unwrap()
            .insert(a, (Instant::now() - WINDOW, 2));
        assert_eq!(l.admit(Some(a)), Ok(()));
    }

    /// Issue 29, finding 5: a full map of client windows refuses a new
    /// client instead of letting it through uncounted; IPv6 clients count
    /// per /64; all clients together are held to the global rate.
    #[test]
    fn the_rate_fails_closed_keys_ipv6_by_64_and_has_a_global_cap() {
        let l = AttestationLimits::new(1, Duration::from_secs(10));
        {
            let mut w = l.windows.lock().unwrap();
            for i in 0..MAX_ENTRIES as u32 {
                w.insert(IpAddr::V4(i.into()), (Instant::now(), 1));
            }
        }
        let new: IpAddr = "203.0.113.9".parse().unwrap();
        assert!(
            l.admit(Some(new)).is_err(),
            "a full map let a new client in"
        );

        let l = AttestationLimits::new(1, Duration::from_secs(10));
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let same64: IpAddr = "2001:db8:1:2:ffff::7".parse().unwrap();
        let other64: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(l.admit(Some(a)), Ok(()));
        assert!(
            l.admit(Some(same64)).is_err(),
            "another address of the same /64"
        );
        assert_eq!(l.admit(Some(other64)), Ok(()));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(l.admit(Some(mapped)), Ok(()));
        assert!(l.admit(Some("10.0.0.1".parse().unwrap())).is_err());

        let l = AttestationLimits::new(1000, Duration::from_secs(10));
        let admitted = (0..FRESH_PER_SECOND + 20)
            .filter(|i| l.admit(Some(IpAddr::V4((0x0a00_0000 + i).into()))).is_ok())
            .count();
        assert_eq!(admitted, FRESH_PER_SECOND as usize);
    }

    #[test]
    fn slots_are_shared_per_nonce_and_connection_while_young() {
        let l = AttestationLimits::new(1, Duration::from_secs(10));
        let s1 = l.slot("m", 1, b"n");
        assert!(Arc::ptr_eq(&s1, &l.slot("m", 1, b"n")));
        assert!(!Arc::ptr_eq(&s1, &l.slot("m", 1, b"other")));
        assert!(!Arc::ptr_eq(&s1, &l.slot("m", 2, b"n")), "a new connection");
        assert!(!Arc::ptr_eq(&s1, &l.slot("x", 1, b"n")));
        let off = AttestationLimits::new(1, Duration::ZERO);
        assert!(!Arc::ptr_eq(
            &off.slot("m", 1, b"n"),
            &off.slot("m", 1, b"n")
        ));
        // Bounded: a full cache of young entries serves uncached.
        for i in 0..MAX_ENTRIES {
            l.slot("m", 9, &i.to_be_bytes());
        }
        let a = l.slot("m", 9, b"late");
        assert!(!Arc::ptr_eq(&a, &l.slot("m", 9, b"late")));
        assert!(l.cache.lock().unwrap().len() <= MAX_ENTRIES);
    }
}
