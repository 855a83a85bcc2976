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
//! - **a global rate, shared fairly**: at most [`FRESH_PER_SECOND`] calls
//!   that need fresh evidence per second from all clients together, so many
//!   addresses cannot add up to unbounded work for the stages. A client
//!   takes at most [`fair_share`] of a second's budget: the budget divided
//!   among the clients asking (this second or the last) plus one, so a part
//!   is always left for a client that has not asked yet.
//!
//! A call is checked against its client's rate first and counted (in both
//! rates) only when admitted: a client past its own rate, however fast it
//! keeps asking, spends none of the global budget.
//!
//! The maps are bounded: expired entries are dropped as new ones arrive;
//! past [`MAX_ENTRIES`] a call is served uncached (the cache), and a client
//! with no window kept is refused (the rates: they fail closed, never open).

use proto::bundle::EvidenceBundle;
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::OnceCell;

/// Most cached nonces, and most client windows, kept at once.
pub const MAX_ENTRIES: usize = 4096;
const WINDOW: Duration = Duration::from_secs(60);
const SECOND: Duration = Duration::from_secs(1);
/// Most calls that need fresh evidence per second, all clients together.
pub const FRESH_PER_SECOND: u32 = 50;
/// Whom a call from an unknown address is counted against (for the global
/// rate's shares; it has no per-client window).
const UNKNOWN: IpAddr = IpAddr::V6(Ipv6Addr::UNSPECIFIED);

/// The most fresh-evidence calls one client may take in a second while
/// `askers` clients (itself included) ask: [`FRESH_PER_SECOND`] divided
/// among them and one more, rounded up.
pub fn fair_share(askers: usize) -> u32 {
    let ways = u32::try_from(askers.saturating_add(1)).unwrap_or(u32::MAX);
    FRESH_PER_SECOND.div_ceil(ways).max(1)
}

/// Evidence for one nonce, made once and shared.
pub type SharedBundle = Arc<OnceCell<Arc<EvidenceBundle>>>;

/// What a cached bundle is for: model, pipeline connection (a reconnect
/// brings new stage keys), nonce.
type CacheKey = (String, u64, Vec<u8>);

/// The limiter and cache.
pub struct AttestationLimits {
    per_minute: u32,
    ttl: Duration,
    rates: Mutex<Rates>,
    cache: Mutex<HashMap<CacheKey, (Instant, SharedBundle)>>,
}

/// Both rates, under one lock (a call is counted in both or in neither).
struct Rates {
    /// Per client: the start of its minute and the calls admitted in it.
    windows: HashMap<IpAddr, (Instant, u32)>,
    /// The start of the current one-second window of all clients' calls.
    second: Instant,
    /// Calls admitted in it, all clients together.
    admitted: u32,
    /// The clients that asked in it (within their own rate), with the calls
    /// each was admitted.
    askers: HashMap<IpAddr, u32>,
    /// The clients that asked in the second before.
    last_askers: HashSet<IpAddr>,
    /// How many of `askers` are not in `last_askers`.
    new_askers: usize,
}

impl Rates {
    /// Starts a new second at `now` once the current one is over.
    fn roll(&mut self, now: Instant) {
        let age = now.duration_since(self.second);
        if age < SECOND {
            return;
        }
        let askers = std::mem::take(&mut self.askers);
        self.last_askers = if age < 2 * SECOND {
            askers.into_keys().collect()
        } else {
            HashSet::new()
        };
        self.second = now;
        self.admitted = 0;
        self.new_askers = 0;
    }

    /// Whether `ip` is within its share of this second's global budget;
    /// records it as asking (refused when no more clients can be recorded).
    fn within_share(&mut self, ip: IpAddr) -> bool {
        if !self.askers.contains_key(&ip) {
            if self.askers.len() >= MAX_ENTRIES {
                return false;
            }
            self.askers.insert(ip, 0);
            if !self.last_askers.contains(&ip) {
                self.new_askers += 1;
            }
        }
        let asking = self.last_askers.len() + self.new_askers;
        self.admitted < FRESH_PER_SECOND && self.askers[&ip] < fair_share(asking)
    }
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
            rates: Mutex::new(Rates {
                windows: HashMap::new(),
                second: Instant::now(),
                admitted: 0,
                askers: HashMap::new(),
                last_askers: HashSet::new(),
                new_askers: 0,
            }),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Counts one call that needs fresh evidence from `client`; `Err` with
    /// the seconds to wait when it is over its own rate or its share of the
    /// global one (then nothing is counted).
    pub fn admit(&self, client: Option<IpAddr>) -> Result<(), u64> {
        self.admit_at(client, Instant::now())
    }

    fn admit_at(&self, client: Option<IpAddr>, now: Instant) -> Result<(), u64> {
        let mut r = self.rates.lock().unwrap();
        let r = &mut *r;
        // The client's own rate first: a client past it spends nothing of
        // the global budget.
        let ip = client.map(client_key);
        if let Some(ip) = ip {
            let w = &mut r.windows;
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
        }
        // Then its share of this second's global budget.
        r.roll(now);
        let key = ip.unwrap_or(UNKNOWN);
        if !r.within_share(key) {
            return Err(1);
        }
        r.admitted += 1;
        *r.askers.get_mut(&key).expect("recorded") += 1;
        if let Some(ip) = ip {
            r.windows.get_mut(&ip).expect("kept above").1 += 1;
        }
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
        l.rates
            .lock()
            .unwrap()
            .windows
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
            let w = &mut l.rates.lock().unwrap().windows;
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

    /// Issue 47, finding 3: calls refused by a client's own rate used to
    /// spend the global budget first, so one address asking 4,409 times a
    /// minute left another 1 of 18. Now they spend nothing.
    #[test]
    fn a_client_past_its_rate_spends_none_of_the_global_budget() {
        let l = AttestationLimits::new(2, Duration::from_secs(10));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let admitted = (0..1000).filter(|_| l.admit(Some(a)).is_ok()).count();
        assert_eq!(admitted, 2);
        assert_eq!(l.admit(Some(b)), Ok(()));
        assert_eq!(l.admit(Some(b)), Ok(()));
        assert_eq!(
            l.rates.lock().unwrap().admitted,
            4,
            "only admitted calls count"
        );
    }

    /// A client takes at most its share of a second's global budget, which
    /// always leaves room for one more client; clients that asked in the
    /// second before keep their share.
    #[test]
    fn the_global_budget_is_shared_among_the_clients_asking() {
        assert_eq!(fair_share(1), 25);
        assert_eq!(fair_share(2), 17);
        assert_eq!(fair_share(10_000), 1);
        let l = AttestationLimits::new(1000, Duration::from_secs(10));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let t0 = Instant::now();
        let flood = |at: Instant| (0..200).filter(|_| l.admit_at(Some(a), at).is_ok()).count();
        assert_eq!(flood(t0), 25, "alone, half the budget");
        // A newcomer gets in at once, up to its own share.
        let b_got = (0..200).filter(|_| l.admit_at(Some(b), t0).is_ok()).count();
        assert_eq!(b_got, 17);
        assert_eq!(l.admit_at(Some(a), t0), Err(1), "a is past its share now");
        // The next second both asked before: each is held to its share, and
        // b still gets in after a's flood.
        let t1 = t0 + Duration::from_millis(1100);
        assert_eq!(flood(t1), 17);
        assert_eq!(l.admit_at(Some(b), t1), Ok(()));
        // Unknown addresses share one client's part.
        assert_eq!(l.admit_at(None, t1), Ok(()));
        // Long after, a is alone again.
        assert_eq!(flood(t0 + Duration::from_secs(5)), 25);
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
