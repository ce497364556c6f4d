//! Unit tests of the communicator layer that need no library.

use super::init::check_rank_args;
use super::*;
use rand::Rng;

#[test]
fn unique_id_hex_round_trip() {
    let mut rng = rand::rng();
    let mut bytes = [0u8; 128];
    rng.fill(&mut bytes[..]);
    bytes[0] = 0xab;
    let id = UniqueId::from_bytes(&bytes).unwrap();
    let hex = id.to_hex();
    assert_eq!(hex.len(), 256);
    assert!(hex.starts_with("ab"));
    let back = UniqueId::from_hex(&hex).unwrap();
    assert_eq!(back, id);
    assert_eq!(back.as_bytes(), &bytes);
    assert_eq!(UniqueId::from_hex(&hex.to_uppercase()).unwrap(), id);
    let raw = id.raw();
    for (r, b) in raw.internal.iter().zip(bytes) {
        assert_eq!(*r as u8, b);
    }
    let dbg = format!("{id:?}");
    assert!(dbg.starts_with("UniqueId(ab"), "{dbg}");
    assert!(dbg.len() < 40, "{dbg}");
}

#[test]
fn unique_id_rejects_bad_input() {
    let e = UniqueId::from_bytes(&[0u8; 127]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                call: "UniqueId::from_bytes",
                ..
            }
        ),
        "{e}"
    );
    let e = UniqueId::from_hex("abc").unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let mut bad = "0".repeat(256);
    bad.replace_range(10..12, "zz");
    let e = UniqueId::from_hex(&bad).unwrap_err();
    assert!(e.to_string().contains("zz"), "{e}");
    let e = UniqueId::from_hex(&"é".repeat(128)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
}

#[test]
fn default_config_matches_the_c_initializer() {
    let c = default_config();
    assert_eq!(c.size, 80);
    assert_eq!(c.magic, 0xcafebeef);
    assert_eq!(c.version, 22803);
    for v in [
        c.blocking,
        c.cgaClusterSize,
        c.minCTAs,
        c.maxCTAs,
        c.splitShare,
        c.trafficClass,
        c.collnetEnable,
        c.CTAPolicy,
        c.shrinkShare,
        c.nvlsCTAs,
        c.nChannelsPerNetPeer,
        c.nvlinkCentricSched,
    ] {
        assert_eq!(v, i32::MIN);
    }
    assert!(c.netName.is_null() && c.commName.is_null());
}

#[test]
fn reduce_ops_map_to_nccl_codes() {
    let ops = [
        (ReduceOp::Sum, 0, "sum"),
        (ReduceOp::Prod, 1, "prod"),
        (ReduceOp::Max, 2, "max"),
        (ReduceOp::Min, 3, "min"),
        (ReduceOp::Avg, 4, "avg"),
    ];
    for (op, raw, name) in ops {
        assert_eq!(op.to_raw().0, raw);
        assert_eq!(op.name(), name);
    }
}

#[test]
fn rank_arguments_are_checked() {
    assert!(check_rank_args("x", 0, 0).is_err());
    assert!(check_rank_args("x", 2, 2).is_err());
    assert_eq!(check_rank_args("x", 4, 3).unwrap(), (4, 3));
}

#[test]
fn thread_safety_markers() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<Comm>();
    send_sync::<AbortHandle>();
}
