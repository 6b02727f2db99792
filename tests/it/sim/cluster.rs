//! The simulation of a cluster: two or three nodes with `durability = "object-store"` on the
//! S3 server (`tests/run.sh` starts SeaweedFS), each writing its group commits to the bucket
//! before acknowledging them. Clients send every request to any node (tables take commits from
//! every node; a stream's requests are forwarded to the node that serves it). A node is killed
//! under load, sometimes with its disk lost too, while the others go on; once its lease
//! lapses another node takes its id over, and from then on every node must serve every row and
//! message it acknowledged. A node is also stopped cleanly, killed while it starts, and
//! stopped as soon as it answers.
//!
//! Reads converge rather than hold at once across nodes (a node sees another's rows once they
//! are flushed, and a dead node's once its log is taken over), so each check is retried until
//! it passes or a deadline passes; a write's outcome that was unknown stays unknown (it may
//! surface when its node's log is taken over), checked for "at most once".

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::lanes::{self, Ctx};
use super::model::Model;
use super::server::{SETTINGS, Server};
use super::{Report, Rng};

/// How long the nodes may take to agree after a fault: a lease (2 s) for a takeover, its
/// replay and flush, and the others' manifest refreshes, on a loaded debug build.
const CONVERGE: Duration = Duration::from_secs(120);

/// One step of a cluster simulation.
#[derive(Debug, Clone, Copy)]
pub enum ClusterEvent {
    /// Load for a while, then a check through every node.
    Load { ms: u64 },
    /// `kill -9` of `node` after `ms` of load; the load goes on at the others for `after_ms`;
    /// with `wipe`, its data directory is lost too before it starts again.
    KillUnderLoad {
        node: usize,
        ms: u64,
        after_ms: u64,
        wipe: bool,
    },
    /// SIGTERM of `node` after `ms` of load.
    TermUnderLoad { node: usize, ms: u64 },
    /// `node` killed and started, and killed again `ms` into that start.
    KillDuringStart { node: usize, ms: u64 },
    /// `node` stopped (SIGTERM, or `kill -9` with `kill`) as soon as it answers, twice.
    StopAfterStart { node: usize, kill: bool },
    /// SIGTERM of `node` after `ms` of load and `kill -9` `after_ms` later, in its shutdown.
    KillDuringShutdown { node: usize, ms: u64, after_ms: u64 },
    /// `node` paused (`SIGSTOP`) under load for `pause_ms` (past its lease: it is taken over
    /// and must acknowledge nothing more), then let go on (`SIGCONT`).
    Pause { node: usize, ms: u64, pause_ms: u64 },
    /// Two nodes killed at once under load (three-node clusters).
    KillTwo { first: usize, ms: u64 },
    /// `kill -9` of `node` under load and a start with other settings.
    Settings {
        node: usize,
        ms: u64,
        variant: usize,
    },
}

impl ClusterEvent {
    fn draw(rng: &mut Rng, nodes: usize) -> ClusterEvent {
        let node = rng.below(nodes as u64) as usize;
        match rng.below(100) {
            0..=14 => ClusterEvent::Load {
                ms: rng.between(300, 1500),
            },
            15..=59 => ClusterEvent::KillUnderLoad {
                node,
                ms: rng.between(100, 2500),
                after_ms: rng.between(0, 3000),
                wipe: rng.chance(30),
            },
            60..=74 => ClusterEvent::TermUnderLoad {
                node,
                ms: rng.between(100, 1500),
            },
            75..=80 => ClusterEvent::KillDuringStart {
                node,
                ms: rng.between(0, 1500),
            },
            81..=85 => ClusterEvent::StopAfterStart {
                node,
                kill: rng.chance(50),
            },
            86..=89 => ClusterEvent::KillDuringShutdown {
                node,
                ms: rng.between(100, 1500),
                after_ms: rng.between(0, 400),
            },
            90..=94 => ClusterEvent::Pause {
                node,
                ms: rng.between(100, 1500),
                pause_ms: rng.between(3000, 6000),
            },
            95..=97 if nodes > 2 => ClusterEvent::KillTwo {
                first: node,
                ms: rng.between(100, 2000),
            },
            _ => ClusterEvent::Settings {
                node,
                ms: rng.between(100, 1500),
                variant: rng.below(SETTINGS.len() as u64) as usize,
            },
        }
    }
}

/// Checks through every running node until each serves everything acknowledged (or the
/// deadline passes). What is served must be right at every reading: a safety problem (a
/// write served twice, partly, altered, refused or unsent, a deleted stream served) fails at
/// once; only what is not served yet is waited for.
async fn converge(ctx: &Ctx, nodes: &[&Server]) -> Result<(), String> {
    let deadline = Instant::now() + CONVERGE;
    for node in nodes {
        loop {
            match lanes::check(ctx, &node.base()).await {
                Ok(_) => break,
                Err(problems) if !problems.safety.is_empty() => {
                    return Err(format!("{} serves:\n{}", node.name, problems.all()));
                }
                Err(problems) if Instant::now() > deadline => {
                    return Err(format!(
                        "{} did not come to serve what was acknowledged within {CONVERGE:?}:\n{}",
                        node.name,
                        problems.all()
                    ));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }
    Ok(())
}

/// One cluster simulation of `count` nodes on the bucket prefix `store`.
pub async fn run_cluster(
    seed: u64,
    events: usize,
    count: usize,
    store: &str,
) -> Result<Report, String> {
    let mut rng = Rng::new(seed);
    let root = crate::common::temp_dir(&format!("sim-cluster-{seed}"));
    let settings = rng.below(SETTINGS.len() as u64) as usize;
    let mut nodes: Vec<Server> = (0..count)
        .map(|i| {
            let mut node = Server::new(&format!("node{i}"), root.join(format!("n{i}")), settings);
            node.env = vec![
                ("SLUICE_DURABILITY".into(), "object-store".into()),
                ("SLUICE_NODE_LEASE_SECONDS".into(), "2".into()),
            ];
            node.args = vec!["--object-store".into(), store.to_owned()];
            node.cluster = true;
            node
        })
        .collect();
    let fail = |event: usize, what: String| {
        format!(
            "seed {seed}, {count} nodes, event {event}: {what}\n(rerun: SLUICE_SIM_SEED={seed} \
             SLUICE_SIM_EVENTS={events} bash tests/run.sh --test it -- --exact \
             sim::the_lifecycle_simulator_finds_no_violation_in_a_cluster --nocapture)"
        )
    };
    for node in &mut nodes {
        node.start().await.map_err(|e| fail(0, e))?;
    }
    let ctx = Ctx {
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap(),
        bases: Arc::new(nodes.iter().map(Server::base).collect()),
        model: Arc::new(Mutex::new(Model::default())),
        stop: Arc::new(AtomicBool::new(false)),
        // A catalog change reaches the other nodes at their next refresh: the scratch
        // table's create-drop cycle is checked in the single-node simulation.
        scratch: false,
    };
    let stream_names: Vec<String> = (0..4).map(|i| format!("c{i}")).collect();
    lanes::setup(&ctx, &stream_names)
        .await
        .map_err(|e| fail(0, e))?;
    let mut report = Report::default();
    for i in 0..events {
        let event = ClusterEvent::draw(&mut rng, count);
        println!("[sim {seed}] cluster event {i}: {event:?} (settings {settings})");
        ctx.model
            .lock()
            .unwrap()
            .note(format!("EVENT {i}: {event:?}"));
        let result = run_event(
            &ctx,
            &mut nodes,
            &mut rng,
            &stream_names,
            event,
            &mut report,
        )
        .await;
        let violations = std::mem::take(&mut ctx.model.lock().unwrap().violations);
        let all: Vec<&Server> = nodes.iter().collect();
        if let Err(e) = result {
            return Err(fail(i, super::with_history(&ctx, &all, e)));
        }
        if !violations.is_empty() {
            return Err(fail(
                i,
                super::with_history(&ctx, &all, violations.join("\n")),
            ));
        }
        report.events += 1;
    }
    report.starts = nodes.iter().map(|n| n.starts).sum();
    report.summary = lanes::summary(&ctx.model.lock().unwrap());
    for node in &mut nodes {
        node.term().await.map_err(|e| fail(events, e))?;
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(report)
}

async fn run_event(
    ctx: &Ctx,
    nodes: &mut [Server],
    rng: &mut Rng,
    stream_names: &[String],
    event: ClusterEvent,
    report: &mut Report,
) -> Result<(), String> {
    match event {
        ClusterEvent::Load { ms } => {
            let lanes = lanes::start_lanes(ctx, rng, stream_names);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            lanes::stop_lanes(ctx, lanes).await;
        }
        ClusterEvent::KillUnderLoad {
            node,
            ms,
            after_ms,
            wipe,
        } => {
            let lanes = lanes::start_lanes(ctx, rng, stream_names);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            nodes[node].kill()?;
            report.kills += 1;
            if wipe {
                // Its disk is gone with it: what it acknowledged lives in the bucket only.
                let _ = std::fs::remove_dir_all(nodes[node].dir.join("data"));
            }
            // The others go on while it is gone.
            tokio::time::sleep(Duration::from_millis(after_ms)).await;
            lanes::stop_lanes(ctx, lanes).await;
            // Everything it acknowledged is served by the others once they take it over.
            converge(ctx, &others(nodes, &[node])).await?;
            nodes[node].start().await?;
        }
        ClusterEvent::TermUnderLoad { node, ms } => {
            let lanes = lanes::start_lanes(ctx, rng, stream_names);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            nodes[node].term().await?;
            lanes::stop_lanes(ctx, lanes).await;
            nodes[node].start().await?;
        }
        ClusterEvent::KillDuringStart { node, ms } => {
            nodes[node].kill()?;
            report.kills += 1;
            nodes[node].spawn();
            tokio::time::sleep(Duration::from_millis(ms)).await;
            nodes[node].kill()?;
            report.kills += 1;
            nodes[node].start().await?;
        }
        ClusterEvent::KillDuringShutdown { node, ms, after_ms } => {
            let lanes = lanes::start_lanes(ctx, rng, stream_names);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            nodes[node]
                .term_then_kill(Duration::from_millis(after_ms))
                .await?;
            report.kills += 1;
            lanes::stop_lanes(ctx, lanes).await;
            nodes[node].start().await?;
        }
        ClusterEvent::Pause { node, ms, pause_ms } => {
            let lanes = lanes::start_lanes(ctx, rng, stream_names);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            nodes[node].pause(true);
            tokio::time::sleep(Duration::from_millis(pause_ms)).await;
            nodes[node].pause(false);
            // Woken past its lease, it finds it was taken over and exits, for its supervisor
            // to start it again (or it was not taken over yet and goes on).
            tokio::time::sleep(Duration::from_millis(1500)).await;
            lanes::stop_lanes(ctx, lanes).await;
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if nodes[node].exited_fenced()? {
                    nodes[node].start().await?;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        ClusterEvent::KillTwo { first, ms } => {
            let second = (first + 1) % nodes.len();
            let lanes = lanes::start_lanes(ctx, rng, stream_names);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            nodes[first].kill()?;
            nodes[second].kill()?;
            report.kills += 2;
            tokio::time::sleep(Duration::from_millis(500)).await;
            lanes::stop_lanes(ctx, lanes).await;
            converge(ctx, &others(nodes, &[first, second])).await?;
            nodes[first].start().await?;
            nodes[second].start().await?;
        }
        ClusterEvent::Settings { node, ms, variant } => {
            let lanes = lanes::start_lanes(ctx, rng, stream_names);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            nodes[node].kill()?;
            report.kills += 1;
            lanes::stop_lanes(ctx, lanes).await;
            nodes[node].settings = variant;
            nodes[node].start().await?;
        }
        ClusterEvent::StopAfterStart { node, kill } => {
            for _ in 0..2 {
                if kill {
                    nodes[node].kill()?;
                    report.kills += 1;
                } else {
                    nodes[node].term().await?;
                }
                nodes[node].start().await?;
            }
        }
    }
    let all: Vec<&Server> = nodes.iter().collect();
    converge(ctx, &all).await?;
    report.checks += 1;
    Ok(())
}

/// The nodes other than those in `gone`.
fn others<'a>(nodes: &'a [Server], gone: &[usize]) -> Vec<&'a Server> {
    nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| !gone.contains(i))
        .map(|(_, n)| n)
        .collect()
}
