//! Replicas of remote stages found through DNS (`dns://host:port` stage
//! addresses, e.g. a Kubernetes headless Service per stage Deployment):
//! every address a stage's name resolves to is one instance of that stage,
//! and the gateway pairs instances into chains, one per replica slot
//! (`replicas` slots). The names are resolved again every
//! `discovery_secs`: a chain whose every address still resolves keeps its
//! slot; a slot whose chain lost an address is emptied (its replica stops
//! being used once its channels break); new addresses form new chains in
//! empty slots. So scaling a stage Deployment up or down needs no gateway
//! change, up to `replicas` chains.

use super::Pipeline;
use proto::io::transport::Endpoint;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Each slot's chain: one address per stage, or `None` (an empty slot).
pub type Slots = Vec<Option<Vec<SocketAddr>>>;

/// Updates `slots` for what each stage's name resolves to now
/// (`resolved[stage]`); returns the slots that changed. Kept chains are
/// never re-paired; a new chain takes stage 0's lowest free address and,
/// for every other stage, a free address on the same host if there is one
/// (one pod holding a whole replica), else that stage's lowest free
/// address; slots fill in order, so the pairing is the same on every
/// gateway that sees the same addresses.
pub fn assign(slots: &mut Slots, resolved: &[Vec<SocketAddr>]) -> Vec<usize> {
    let mut changed = Vec::new();
    for (k, slot) in slots.iter_mut().enumerate() {
        let gone = slot
            .as_ref()
            .is_some_and(|chain| chain.iter().zip(resolved).any(|(a, all)| !all.contains(a)));
        if gone {
            *slot = None;
            changed.push(k);
        }
    }
    let mut free: Vec<Vec<SocketAddr>> = resolved
        .iter()
        .enumerate()
        .map(|(i, all)| {
            let mut f: Vec<SocketAddr> = all
                .iter()
                .filter(|a| !slots.iter().flatten().any(|chain| chain[i] == **a))
                .copied()
                .collect();
            f.sort();
            f.dedup();
            f.reverse(); // lowest last, for pop()
            f
        })
        .collect();
    for (k, slot) in slots.iter_mut().enumerate() {
        if slot.is_none() && free.iter().all(|f| !f.is_empty()) {
            let first = free[0].pop().expect("checked");
            let mut chain = vec![first];
            for f in free.iter_mut().skip(1) {
                let at = f
                    .iter()
                    .rposition(|a| a.ip() == first.ip())
                    .unwrap_or(f.len() - 1);
                chain.push(f.remove(at));
            }
            *slot = Some(chain);
            if !changed.contains(&k) {
                changed.push(k);
            }
        }
    }
    changed
}

/// Every address `name` (`host:port`) resolves to.
pub async fn resolve(name: &str) -> std::io::Result<Vec<SocketAddr>> {
    let mut all: Vec<SocketAddr> = tokio::net::lookup_host(name).await?.collect();
    all.sort();
    all.dedup();
    Ok(all)
}

/// Every stage's addresses, or the first name that does not resolve.
pub async fn resolve_all(names: &[String]) -> Result<Vec<Vec<SocketAddr>>, String> {
    let mut out = Vec::new();
    for n in names {
        out.push(
            resolve(n)
                .await
                .map_err(|e| format!("resolving {n}: {e}"))?,
        );
    }
    Ok(out)
}

/// A slot's chain as stage endpoints.
pub fn endpoints(chain: &[SocketAddr]) -> Vec<Endpoint> {
    chain.iter().map(|a| Endpoint::Tcp(a.to_string())).collect()
}

/// Points each changed slot's pipeline at its new chain (or at none).
pub fn apply(members: &[Arc<Pipeline>], slots: &Slots, changed: &[usize]) {
    for &k in changed {
        let chain = slots[k].as_deref();
        tracing::info!(
            replica = k,
            chain = ?chain.map(|c| c.iter().map(ToString::to_string).collect::<Vec<_>>()),
            "replica slot assigned from DNS"
        );
        members[k].set_targets(chain.map(endpoints));
    }
}

/// Resolves the stage names until a whole chain of stages appears (or
/// `within` passes) and pairs the addresses into the first `count` slots.
pub async fn first_slots(
    names: &[String],
    count: usize,
    within: Duration,
) -> anyhow::Result<Slots> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let mut slots = vec![None; count];
        let failed = match resolve_all(names).await {
            Ok(resolved) => {
                assign(&mut slots, &resolved);
                if slots.iter().any(Option::is_some) {
                    return Ok(slots);
                }
                format!("DNS names no whole chain of stages ({})", names.join(", "))
            }
            Err(e) => e,
        };
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!(failed);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Resolves the names every `every` and re-pairs the slots, for as long
/// as the gateway runs. A failed resolution changes nothing.
pub async fn run(
    members: Vec<Arc<Pipeline>>,
    names: Vec<String>,
    mut slots: Slots,
    every: Duration,
) {
    loop {
        tokio::time::sleep(every).await;
        match resolve_all(&names).await {
            Ok(resolved) => {
                let changed = assign(&mut slots, &resolved);
                apply(&members, &slots, &changed);
            }
            Err(e) => tracing::warn!(error = %e, "stage discovery: keeping the current replicas"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(last: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, last], 9000))
    }

    #[test]
    fn chains_are_kept_formed_from_new_addresses_and_emptied_when_one_goes() {
        let mut slots: Slots = vec![None; 3];
        // Two instances of stage 0, three of stage 1: two chains.
        let changed = assign(&mut slots, &[vec![a(2), a(1)], vec![a(13), a(11), a(12)]]);
        assert_eq!(changed, [0, 1]);
        assert_eq!(slots[0], Some(vec![a(1), a(11)]));
        assert_eq!(slots[1], Some(vec![a(2), a(12)]));
        assert_eq!(slots[2], None);
        // Nothing new: nothing changes.
        assert!(assign(&mut slots, &[vec![a(1), a(2)], vec![a(11), a(12), a(13)]]).is_empty());
        // Stage 0 scales up: the spare stage-1 instance gets a partner.
        let changed = assign(
            &mut slots,
            &[vec![a(1), a(2), a(3)], vec![a(11), a(12), a(13)]],
        );
        assert_eq!(changed, [2]);
        assert_eq!(slots[2], Some(vec![a(3), a(13)]));
        // A stage-1 instance goes (and a replacement appears): only its
        // chain changes; the others keep their pairing.
        let changed = assign(
            &mut slots,
            &[vec![a(1), a(2), a(3)], vec![a(11), a(13), a(14)]],
        );
        assert_eq!(changed, [1]);
        assert_eq!(slots[0], Some(vec![a(1), a(11)]));
        assert_eq!(slots[1], Some(vec![a(2), a(14)]));
        assert_eq!(slots[2], Some(vec![a(3), a(13)]));
        // Scaled down to one instance each: one chain is left.
        let changed = assign(&mut slots, &[vec![a(3)], vec![a(13)]]);
        assert_eq!(changed, [0, 1]);
        assert_eq!(slots, vec![None, None, Some(vec![a(3), a(13)])]);
        // More instances than slots: the extra ones wait.
        let mut one: Slots = vec![None];
        assign(&mut one, &[vec![a(1), a(2)], vec![a(11), a(12)]]);
        assert_eq!(one, vec![Some(vec![a(1), a(11)])]);
    }

    #[test]
    fn a_new_chain_stays_on_one_host_where_it_can() {
        let at = |host: u8, port: u16| SocketAddr::from(([10, 0, 1, host], port));
        // One pod per replica (stage 0 on :9000, stage 1 on :9001); pod 5
        // has lost its place in the middle of the order.
        let mut slots: Slots = vec![Some(vec![at(5, 9000), at(5, 9001)]), None, None];
        let changed = assign(
            &mut slots,
            &[
                vec![at(3, 9000), at(5, 9000), at(7, 9000)],
                vec![at(7, 9001), at(5, 9001), at(3, 9001)],
            ],
        );
        assert_eq!(changed, [1, 2]);
        assert_eq!(slots[1], Some(vec![at(3, 9000), at(3, 9001)]));
        assert_eq!(slots[2], Some(vec![at(7, 9000), at(7, 9001)]));
    }
}
