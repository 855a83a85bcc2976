//! Building the data path: attesting and configuring every stage (and
//! checking its boot evidence), the entry stage's signed key sets, reading
//! each stage's channel, noticing a break, and rebuilding after one.

use super::{ConnectError, Connected, Pipeline, StageStatus, StageTarget, UNASSIGNED};
use proto::attestation::{
    claims_binding, verify_boot, Evidence, EvidenceFormat, EvidencePurpose, Measurement,
};
use proto::channel::{ChannelError, LocalIdentity, PeerInfo};
use proto::frames::{HostMessage, StageClaims, StageReply};
use proto::io::channel::{self, ChannelReceiver, ChannelSender};
use proto::io::queue::QueuedSender;
use proto::io::transport;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

impl Pipeline {
    /// Connects once; on failure says why (naming the stage) and whether the
    /// stage was reached but refused by policy (`rejected`, also counted in
    /// `attestation_failures`).
    pub async fn connect(self: &Arc<Self>) -> Result<(), ConnectError> {
        let r = self.connect_once().await;
        if matches!(&r, Err(e) if e.rejected) {
            self.attestation_failures.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    async fn connect_once(self: &Arc<Self>) -> Result<(), ConnectError> {
        if !self.is_assigned() {
            return Err(ConnectError::unreachable(UNASSIGNED.into()));
        }
        let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        let targets = self.targets.lock().unwrap().clone();
        let n = targets.len();
        let mut channels: Vec<Option<(ChannelSender, ChannelReceiver)>> =
            (0..n).map(|_| None).collect();
        let mut stages = Vec::new();
        let mut entry_key_set = None;
        // Exit stage first, so that each stage's next hop is already configured.
        for i in (0..n).rev() {
            let t = &targets[i];
            let stream = transport::connect(&t.endpoint).await.map_err(|e| {
                ConnectError::unreachable(format!("stage {i} at {}: {e}", t.endpoint))
            })?;
            let check = |p: &PeerInfo| self.check_stage(i as u32, n, t, p);
            let (mut tx, mut rx, peer) =
                channel::initiate(stream, &LocalIdentity::host(), self.limits, &check)
                    .await
                    .map_err(|e| ConnectError {
                        rejected: matches!(e, ChannelError::PeerRejected(_)),
                        reason: format!("stage {i} at {}: {e}", t.endpoint),
                    })?;
            let next = (i + 1 < n).then(|| targets[i + 1].peer_endpoint().to_string());
            // A generation exit stage sends sampled tokens back to the entry stage.
            let feedback = (self.is_generation() && n > 1 && i + 1 == n)
                .then(|| targets[0].peer_endpoint().to_string());
            let key_ids = (i == 0).then(|| [*self.key_ids.start(), *self.key_ids.end()]);
            tx.send_msg(&HostMessage::Configure {
                next,
                feedback,
                key_ids,
            })
            .await
            .map_err(|e| ConnectError::unreachable(format!("stage {i}: {e}")))?;
            let (boot, clock) = match rx.recv_msg::<StageReply>().await {
                Ok(Some(StageReply::Configured {
                    boot_evidence,
                    key_set,
                    clock,
                })) => {
                    if i == 0 {
                        entry_key_set = key_set.map(serde_bytes::ByteBuf::into_vec);
                    }
                    (boot_evidence, clock)
                }
                Ok(Some(StageReply::ConfigureFailed(why))) => {
                    return Err(ConnectError {
                        rejected: why.contains("not accepted"),
                        reason: format!("stage {i}: {why}"),
                    })
                }
                Ok(Some(_)) => {
                    return Err(ConnectError::unreachable(format!(
                        "stage {i} answered configuration with something else"
                    )))
                }
                Ok(None) => {
                    return Err(ConnectError::unreachable(format!(
                        "stage {i} closed the channel during configuration"
                    )))
                }
                Err(e) => return Err(ConnectError::unreachable(format!("stage {i}: {e}"))),
            };
            let doc = peer.document.as_ref().expect("stages are attested");
            let claims = peer.claims.clone().expect("stages make claims");
            check_boot_evidence(&boot, &claims, &doc.measurement).map_err(|why| ConnectError {
                rejected: true,
                reason: format!("stage {i}: boot evidence refused: {why}"),
            })?;
            stages.push(StageStatus {
                index: i as u32,
                layers: t.layers,
                evidence: match doc.format {
                    EvidenceFormat::Mock => "mock",
                    EvidenceFormat::Nitro => "nitro",
                },
                measurement: doc.measurement.pinned_form(),
                debug: matches!(&doc.measurement, Measurement::Nitro(p) if p.is_debug()),
                clock,
                endpoint: t.endpoint.to_string(),
                claims,
                boot_evidence: boot,
            });
            channels[i] = Some((tx, rx));
        }
        stages.reverse();
        let (entry_keys, _) =
            proto::bundle::entry_keys(&stages[0].claims, entry_key_set.as_deref()).map_err(
                |e| ConnectError {
                    rejected: true,
                    reason: format!("stage 0: its HPKE keys are unusable: {e}"),
                },
            )?;
        let mut senders = Vec::new();
        let mut readers = Vec::new();
        for (i, ch) in channels.into_iter().enumerate() {
            let (tx, rx) = ch.expect("every stage connected");
            let this = self.clone();
            readers.push(
                tokio::spawn(async move { this.read_stage(i, rx, epoch).await }).abort_handle(),
            );
            senders.push(QueuedSender::spawn(tx));
        }
        *self.connected.lock().unwrap() = Some(Connected {
            senders,
            readers,
            stages,
            entry_keys,
            key_set: entry_key_set,
            epoch,
        });
        Ok(())
    }

    /// The entry stage rotated its HPKE key: publish its new signed set.
    /// A set its attested receipt key did not sign breaks the pipeline.
    fn on_key_set(&self, epoch: u64, set: Vec<u8>) -> Result<(), String> {
        let mut connected = self.connected.lock().unwrap();
        let Some(c) = connected.as_mut().filter(|c| c.epoch == epoch) else {
            return Ok(());
        };
        (c.entry_keys, _) = proto::bundle::entry_keys(&c.stages[0].claims, Some(&set))?;
        c.key_set = Some(set);
        tracing::info!(
            model = %self.model_id,
            keys = ?c.entry_keys.iter().map(|k| k.key_id).collect::<Vec<_>>(),
            "entry stage rotated its HPKE key"
        );
        Ok(())
    }

    /// The entry stage's HPKE keys as it last signed them (served in the
    /// evidence bundle).
    pub fn key_set(&self) -> Option<Vec<u8>> {
        let connected = self.connected.lock().unwrap();
        connected.as_ref().and_then(|c| c.key_set.clone())
    }

    fn check_stage(
        &self,
        index: u32,
        n: usize,
        t: &StageTarget,
        p: &PeerInfo,
    ) -> Result<(), String> {
        let (Some(doc), Some(c)) = (&p.document, &p.claims) else {
            return Err("stage presented no evidence".into());
        };
        self.policy
            .check(doc, c, self.local_measurement.as_ref())
            .map_err(|e| e.to_string())?;
        if c.stage_index != index || c.num_stages as usize != n {
            return Err(format!(
                "stage {index}: claims to be stage {} of {}, expected {index} of {}",
                c.stage_index, c.num_stages, n
            ));
        }
        if [c.layer_start, c.layer_end] != t.layers {
            return Err(format!(
                "stage {index}: claims layers [{}, {}), configured [{}, {})",
                c.layer_start, c.layer_end, t.layers[0], t.layers[1]
            ));
        }
        if c.manifest_sha256 != self.manifest.digest {
            return Err(format!(
                "stage {index}: serves manifest {}, the gateway's is {}",
                c.manifest_sha256, self.manifest.digest
            ));
        }
        Ok(())
    }

    async fn read_stage(self: Arc<Self>, index: usize, mut rx: ChannelReceiver, epoch: u64) {
        let reason = loop {
            match rx.recv_msg::<StageReply>().await {
                Ok(Some(StageReply::Result(m))) => self.on_result(m),
                Ok(Some(StageReply::Evidence { nonce, evidence })) => {
                    let waiters = self.attest_waiters.lock().unwrap().remove(&(index, nonce));
                    for w in waiters.into_iter().flatten() {
                        let _ = w.send(evidence.clone());
                    }
                }
                Ok(Some(StageReply::Stats(stats))) => {
                    let waiters = self.stats_waiters.lock().unwrap().remove(&index);
                    for w in waiters.into_iter().flatten() {
                        let _ = w.send(stats.clone());
                    }
                }
                Ok(Some(StageReply::KeySet(set))) if index == 0 => {
                    if let Err(why) = self.on_key_set(epoch, set.into_vec()) {
                        break format!("stage 0: {why}");
                    }
                }
                Ok(Some(StageReply::DownstreamLost(why))) => {
                    break format!("stage {index} lost its next stage: {why}")
                }
                Ok(Some(other)) => {
                    break format!("stage {index} sent an unexpected message: {other:?}")
                }
                Ok(None) => break format!("stage {index} disconnected"),
                Err(e) => break format!("stage {index} channel failed: {e}"),
            }
        };
        self.mark_broken(epoch, reason);
    }

    fn mark_broken(&self, epoch: u64, reason: String) {
        if self.closing.load(Ordering::SeqCst) {
            return;
        }
        let old = {
            let mut c = self.connected.lock().unwrap();
            if c.as_ref().map(|c| c.epoch) != Some(epoch) {
                return;
            }
            c.take()
        };
        // Close every channel of the broken pipeline, the surviving stages'
        // too: a stage accepts a new configuration only once the host
        // channel that configured it has closed.
        if let Some(old) = old {
            for r in old.readers {
                r.abort();
            }
            for tx in old.senders {
                tokio::spawn(async move { tx.shutdown().await });
            }
        }
        *self.not_ready_reason.lock().unwrap() = reason.clone();
        // Dropping the waiters' senders fails every pending request with 503.
        let failed = self.pending.lock().unwrap().drain().count();
        self.attest_waiters.lock().unwrap().clear();
        self.stats_waiters.lock().unwrap().clear();
        tracing::warn!(reason = %reason, failed_requests = failed, "pipeline broken");
        self.broken.notify_one();
    }

    /// After the first connection: waits for a break, then reconnects until
    /// the stages answer and verify again; forever.
    pub async fn supervise_after_first(self: Arc<Self>) {
        loop {
            self.broken.notified().await;
            if self.epoch().is_some() {
                // A stale wake-up (new addresses arrived while it was
                // reconnecting anyway): it is connected.
                continue;
            }
            let mut last = String::new();
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if self.closing.load(Ordering::SeqCst) {
                    return;
                }
                match self.connect().await {
                    Ok(()) => {
                        self.reconnects.fetch_add(1, Ordering::Relaxed);
                        tracing::info!("pipeline reconnected");
                        self.log_verified();
                        break;
                    }
                    Err(e) => {
                        *self.not_ready_reason.lock().unwrap() = e.reason.clone();
                        if e.reason != last {
                            tracing::error!(reason = %e.reason, "pipeline not ready");
                            last = e.reason;
                        }
                    }
                }
            }
        }
    }

    /// Closes every stage channel (the sending direction, cleanly, where no
    /// request still holds it) and stops reconnecting: the last step of a
    /// graceful shutdown.
    pub async fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
        *self.not_ready_reason.lock().unwrap() = "the gateway is shutting down".into();
        let connected = self.connected.lock().unwrap().take();
        self.pending.lock().unwrap().clear();
        let Some(c) = connected else { return };
        for tx in c.senders {
            tx.shutdown().await;
        }
        tracing::info!("stage channels closed");
    }

    /// Logs what was verified (called whenever the pipeline comes up).
    pub fn log_verified(&self) {
        let st = self.status().unwrap_or_default();
        for s in &st {
            tracing::info!(
                stage = s.index,
                layers = ?s.layers,
                evidence = s.evidence,
                measurement = %s.measurement,
                "stage attested and verified against policy"
            );
        }
        if st.iter().any(|s| s.evidence == "mock") {
            tracing::warn!("MOCK ATTESTATION: stages run without enclave hardware; their evidence proves nothing");
        }
    }
}

/// Checks that a stage's boot evidence verifies (Nitro: at its own time,
/// since it was made at stage start), binds its receipt key and the same
/// claims as its channel evidence, and has the same measurement.
pub fn check_boot_evidence(
    boot: &Evidence,
    claims: &StageClaims,
    measurement: &Measurement,
) -> Result<(), String> {
    let doc = verify_boot(boot).map_err(|e| e.to_string())?;
    if &doc.measurement != measurement {
        return Err("its measurement differs from the channel evidence".into());
    }
    if doc.public_key != claims.receipt_key {
        return Err("it is not bound to the stage's receipt key".into());
    }
    if doc.user_data
        != claims_binding(
            doc.format,
            EvidencePurpose::Boot,
            &proto::cbor::to_vec(claims),
        )
    {
        return Err("its claims differ from the channel evidence".into());
    }
    Ok(())
}
