//! Tests of the flight recorder (ring, states, dumps) and of `analyze` on
//! synthetic dumps of several ranks.

use std::path::PathBuf;
use std::sync::Arc;

use metrale_comm::diagnostics::{
    Dump, DumpHeader, FindingKind, FlightRecorder, OpRecord, OpState, analyze, analyze_generation,
    dump_file_name,
};
use rand::Rng;

fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("metrale-diag-{tag}-{}-{nanos}", std::process::id()))
}

const OPS: [&str; 4] = ["all_reduce", "broadcast", "all_gather", "reduce_scatter"];
const DTYPES: [&str; 3] = ["bf16", "f32", "u8"];

#[test]
fn ring_wraps_and_keeps_the_newest() {
    let mut rng = rand::rng();
    let cap = 8;
    let rec = FlightRecorder::new(cap);
    assert_eq!(rec.last_seq(), 0);
    assert!(rec.snapshot().is_empty());
    assert!(rec.get(1).is_none());
    let mut expected = Vec::new();
    for i in 0..21u64 {
        let op = OPS[rng.random_range(0..OPS.len())];
        let dtype = DTYPES[rng.random_range(0..DTYPES.len())];
        let bytes = rng.random_range(1..1_000_000usize);
        let stream = rng.random_range(1..u64::MAX);
        let peer = if rng.random_bool(0.5) {
            Some(rng.random_range(0..8usize))
        } else {
            None
        };
        let seq = rec.record(op, dtype, bytes, stream, peer);
        assert_eq!(seq, i + 1);
        expected.push((seq, op, dtype, bytes, stream, peer));
    }
    assert_eq!(rec.last_seq(), 21);
    let snap = rec.snapshot();
    assert_eq!(snap.len(), cap);
    for (got, want) in snap.iter().zip(&expected[21 - cap..]) {
        assert_eq!(got.seq, want.0);
        assert_eq!(got.op, want.1);
        assert_eq!(got.dtype, want.2);
        assert_eq!(got.bytes, want.3);
        assert_eq!(got.stream, want.4);
        assert_eq!(got.peer, want.5);
        assert_eq!(got.state, OpState::Enqueued);
        assert_eq!(got.completed_after_us, None);
        assert!(got.enqueued_unix_us > 0);
        assert_eq!(rec.get(got.seq).as_ref(), Some(got));
    }
    // Evicted and future sequence numbers are absent; set_state on them is a no-op.
    assert!(rec.get(13).is_none());
    assert!(rec.get(0).is_none());
    assert!(rec.get(22).is_none());
    rec.set_state(13, OpState::Failed);
    rec.set_state(22, OpState::Failed);
    assert!(rec.snapshot().iter().all(|r| r.state == OpState::Enqueued));
    assert_eq!(rec.summary(3).lines().count(), 3);
    assert!(rec.summary(3).starts_with("seq 19 "));
    assert_eq!(rec.summary(100).lines().count(), cap);
}

#[test]
fn states_are_recorded() {
    let rec = FlightRecorder::new(16);
    let a = rec.record("all_reduce", "bf16", 8192, 7, None);
    let b = rec.record("broadcast", "bf16", 64, 7, Some(0));
    let c = rec.record("send", "u8", 3, 9, Some(1));
    std::thread::sleep(std::time::Duration::from_millis(2));
    rec.set_state(a, OpState::Completed);
    rec.set_state(b, OpState::TimedOut);
    rec.set_state(c, OpState::Failed);
    let ra = rec.get(a).expect("a");
    assert_eq!(ra.state, OpState::Completed);
    assert!(ra.completed_after_us.expect("completion time") >= 1000);
    let rb = rec.get(b).expect("b");
    assert_eq!(rb.state, OpState::TimedOut);
    assert_eq!(rb.completed_after_us, None);
    assert_eq!(rec.get(c).expect("c").state, OpState::Failed);
    let summary = rec.summary(3);
    assert!(summary.contains("completed"), "{summary}");
    assert!(summary.contains("timed out"), "{summary}");
    assert!(summary.contains("failed"), "{summary}");
}

#[test]
fn concurrent_records_get_unique_sequence_numbers() {
    let rec = Arc::new(FlightRecorder::new(64));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let rec = Arc::clone(&rec);
            std::thread::spawn(move || {
                (0..1000)
                    .map(|i| rec.record("all_reduce", "bf16", i, 0, None))
                    .collect::<Vec<u64>>()
            })
        })
        .collect();
    let mut all: Vec<u64> = threads
        .into_iter()
        .flat_map(|t| t.join().expect("thread"))
        .collect();
    all.sort_unstable();
    assert_eq!(all, (1..=4000).collect::<Vec<u64>>());
    assert_eq!(rec.last_seq(), 4000);
    let snap = rec.snapshot();
    assert_eq!(
        snap.iter().map(|r| r.seq).collect::<Vec<_>>(),
        (3937..=4000).collect::<Vec<u64>>()
    );
}

#[test]
fn dump_round_trips_through_json() {
    let rec = FlightRecorder::new(32);
    let mut rng = rand::rng();
    for i in 0..40 {
        let seq = rec.record("all_gather", "f32", rng.random_range(1..9999), i, None);
        if i % 3 == 0 {
            rec.set_state(seq, OpState::Completed);
        }
    }
    rec.set_state(40, OpState::TimedOut);
    let dir = temp_dir("dump").join("nested");
    let header = DumpHeader {
        rank: 3,
        world_size: 4,
        generation: 2,
        reason: "deadline missed".to_owned(),
        first_failed_seq: Some(40),
    };
    let path = rec.dump_json(&dir, &header).expect("dump");
    assert_eq!(path, dir.join(dump_file_name(3, 2)));
    assert_eq!(
        path.file_name().and_then(|n| n.to_str()),
        Some("metrale-fr-rank3-gen2.json")
    );
    let text = std::fs::read_to_string(&path).expect("read");
    assert!(text.contains("\"timed_out\""), "states are snake_case");
    let dump: Dump = serde_json::from_str(&text).expect("parse");
    assert_eq!(dump.header, header);
    assert_eq!(dump.records, rec.snapshot());
    assert_eq!(dump.records.len(), 32);
    let entries: Vec<_> = std::fs::read_dir(&dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(entries.len(), 1, "no temporary file is left: {entries:?}");
    std::fs::remove_dir_all(dir.parent().expect("parent")).expect("cleanup");
}

fn record(seq: u64, op: &str, bytes: usize, peer: Option<usize>, state: OpState) -> OpRecord {
    OpRecord {
        seq,
        op: op.to_owned(),
        dtype: "bf16".to_owned(),
        bytes,
        stream: 1,
        peer,
        enqueued_unix_us: 1_700_000_000_000_000 + seq,
        state,
        completed_after_us: (state == OpState::Completed).then_some(10),
    }
}

/// `n` completed all-reduces of 8192 B, seq 1..=n.
fn healthy(n: u64) -> Vec<OpRecord> {
    (1..=n)
        .map(|s| record(s, "all_reduce", 8192, None, OpState::Completed))
        .collect()
}

fn dump(rank: usize, world_size: usize, generation: u64, records: Vec<OpRecord>) -> Dump {
    Dump {
        header: DumpHeader {
            rank,
            world_size,
            generation,
            reason: "test".to_owned(),
            first_failed_seq: None,
        },
        records,
    }
}

#[test]
fn consistent_dumps_have_no_finding() {
    let dumps: Vec<Dump> = (0..4).map(|r| dump(r, 4, 0, healthy(10))).collect();
    let a = analyze(&dumps);
    assert_eq!(a.generation, Some(0));
    assert_eq!(a.world_size, 4);
    assert_eq!(a.ranks_found, vec![0, 1, 2, 3]);
    assert!(a.ranks_missing.is_empty());
    assert_eq!(a.finding, None);
    assert!(!a.found_problem());
    assert!(analyze(&[]).generation.is_none());
}

#[test]
fn missing_rank_is_reported() {
    let dumps = vec![dump(0, 3, 1, healthy(5)), dump(2, 3, 1, healthy(5))];
    let a = analyze(&dumps);
    assert_eq!(a.ranks_found, vec![0, 2]);
    assert_eq!(a.ranks_missing, vec![1]);
    assert!(a.found_problem());
    assert!(a.to_string().contains("missing dumps: rank 1"), "{a}");
}

#[test]
fn rank_that_stopped_early_is_named() {
    let mut r0 = healthy(6);
    r0.push(record(7, "all_reduce", 8192, None, OpState::TimedOut));
    let dumps = vec![dump(0, 2, 0, r0), dump(1, 2, 0, healthy(6))];
    let a = analyze(&dumps);
    let f = a.finding.expect("finding");
    assert_eq!(f.seq, 7);
    assert_eq!(f.kind, FindingKind::NeverReached);
    assert_eq!(f.never_reached, vec![1]);
    assert_eq!(f.timed_out, vec![0]);
    assert_eq!(
        f.description,
        "rank 1 never reached seq 7 (all_reduce bf16 8192 B); rank 0 timed out in it"
    );
}

#[test]
fn disagreeing_op_is_named() {
    let mut r1 = healthy(9);
    r1[4] = record(5, "broadcast", 8192, Some(0), OpState::Completed);
    let dumps = vec![
        dump(0, 3, 0, healthy(9)),
        dump(1, 3, 0, r1),
        dump(2, 3, 0, healthy(9)),
    ];
    let f = analyze(&dumps).finding.expect("finding");
    assert_eq!(f.seq, 5);
    assert_eq!(f.kind, FindingKind::Mismatch);
    assert_eq!(f.mismatched, vec![1]);
    assert!(
        f.description
            .contains("rank 1 broadcast bf16 8192 B peer/root 0"),
        "{}",
        f.description
    );
    assert!(
        f.description.contains("ranks 0,2 all_reduce bf16 8192 B"),
        "{}",
        f.description
    );

    // A byte-count difference is a disagreement too.
    let mut r2 = healthy(9);
    r2[2].bytes = 4096;
    let f = analyze(&[dump(0, 2, 0, healthy(9)), dump(1, 2, 0, r2)])
        .finding
        .expect("finding");
    assert_eq!((f.seq, f.kind), (3, FindingKind::Mismatch));
}

#[test]
fn point_to_point_pairs_are_not_disagreements() {
    let mut r0 = healthy(3);
    let mut r1 = healthy(3);
    r0.push(record(4, "send", 100, Some(1), OpState::Completed));
    r1.push(record(4, "recv", 100, Some(0), OpState::Completed));
    let a = analyze(&[dump(0, 2, 0, r0), dump(1, 2, 0, r1)]);
    assert_eq!(a.finding, None);
}

#[test]
fn failure_with_all_ranks_present_and_generation_choice() {
    let mut r1 = healthy(4);
    r1[3].state = OpState::Failed;
    let dumps = vec![
        dump(0, 2, 5, healthy(4)),
        dump(1, 2, 5, r1),
        // An older generation with a different problem.
        dump(0, 2, 4, healthy(2)),
        dump(1, 2, 4, healthy(1)),
    ];
    let f = analyze(&dumps).finding.expect("finding");
    assert_eq!(
        (f.seq, f.kind, f.failed.clone()),
        (4, FindingKind::Failed, vec![1])
    );
    let old = analyze_generation(&dumps, 4).finding.expect("old finding");
    assert_eq!((old.seq, old.kind), (2, FindingKind::NeverReached));
    assert!(analyze_generation(&dumps, 9).finding.is_none());
}

#[test]
fn wrapped_rings_compare_their_overlap() {
    // Rank 0's ring holds 91..=100, rank 1's holds 86..=95: rank 1 stopped at 95.
    let r0: Vec<OpRecord> = healthy(100).into_iter().skip(90).collect();
    let r1: Vec<OpRecord> = healthy(95).into_iter().skip(85).collect();
    let f = analyze(&[dump(0, 2, 0, r0), dump(1, 2, 0, r1)])
        .finding
        .expect("finding");
    assert_eq!((f.seq, f.never_reached.clone()), (96, vec![1]));
}
