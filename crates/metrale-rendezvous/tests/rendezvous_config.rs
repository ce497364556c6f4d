//! Tests of the rendezvous configuration parsed from text: `RendezvousSpec`
//! URLs (`env://`, `file:///dir`, `tcp://host:port` with their query
//! parameters, and the malformed ones refused) and `EnvConfig` from fake
//! environments (defaults, and each missing or bad variable named). The
//! process environment is never read or changed here.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use metrale_rendezvous::{EnvConfig, RendezvousError, RendezvousSpec, rendezvous_from_url};

const T: Duration = Duration::from_secs(10);

fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    move |k| map.get(k).cloned()
}

#[test]
fn url_parsing() {
    assert_eq!(
        RendezvousSpec::parse("env://").ok(),
        Some(RendezvousSpec::Env)
    );
    assert_eq!(
        RendezvousSpec::parse("file:///tmp/x?world_size=3").ok(),
        Some(RendezvousSpec::File {
            dir: PathBuf::from("/tmp/x"),
            rank: None,
            world_size: Some(3)
        })
    );
    assert_eq!(
        RendezvousSpec::parse("tcp://localhost:29500?rank=2&world_size=4").ok(),
        Some(RendezvousSpec::Tcp {
            host: "localhost".to_owned(),
            port: 29500,
            rank: Some(2),
            world_size: Some(4)
        })
    );
    for bad in [
        "",
        "http://x:1",
        "env://x",
        "file://relative",
        "tcp://host",
        "tcp://host:0",
        "tcp://:80",
        "tcp://h:99999",
        "tcp://h:1?rank=x",
        "tcp://h:1?color=3",
    ] {
        assert!(
            matches!(RendezvousSpec::parse(bad), Err(RendezvousError::BadSpec(_))),
            "{bad:?} must be refused"
        );
    }
    assert!(matches!(
        rendezvous_from_url("file:///tmp/x?rank=4&world_size=4", T),
        Err(RendezvousError::BadEnv { var: "RANK", .. })
    ));
}

#[test]
fn env_config_parsing() {
    let full = [
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let cfg = EnvConfig::from_lookup(lookup(&full)).expect("valid");
    assert_eq!(
        cfg,
        EnvConfig {
            rank: 2,
            world_size: 4,
            local_rank: 1,
            master_addr: "127.0.0.1".to_owned(),
            master_port: 29500
        }
    );
    assert_eq!(
        cfg.master_socket_addr().expect("resolves"),
        SocketAddr::from(([127, 0, 0, 1], 29500))
    );
    // LOCAL_RANK defaults to RANK.
    let no_local: Vec<_> = full
        .iter()
        .copied()
        .filter(|(k, _)| *k != "LOCAL_RANK")
        .collect();
    assert_eq!(
        EnvConfig::from_lookup(lookup(&no_local))
            .expect("valid")
            .local_rank,
        2
    );

    let with = |var: &str, value: Option<&str>| {
        let vars: Vec<(&str, &str)> = full
            .iter()
            .copied()
            .filter(|(k, _)| *k != var)
            .chain(value.map(|v| (var, v)))
            .collect();
        EnvConfig::from_lookup(lookup(&vars))
    };
    let cases: [(&str, Option<&str>, &str); 10] = [
        ("RANK", None, "RANK"),
        ("WORLD_SIZE", None, "WORLD_SIZE"),
        ("MASTER_ADDR", None, "MASTER_ADDR"),
        ("MASTER_ADDR", Some(""), "MASTER_ADDR"),
        ("MASTER_PORT", None, "MASTER_PORT"),
        ("RANK", Some("two"), "RANK"),
        ("MASTER_PORT", Some("70000"), "MASTER_PORT"),
        ("MASTER_PORT", Some("0"), "MASTER_PORT"),
        ("RANK", Some("4"), "RANK"),
        ("WORLD_SIZE", Some("0"), "WORLD_SIZE"),
    ];
    for (var, value, expected) in cases {
        match with(var, value) {
            Err(RendezvousError::BadEnv { var: got, reason }) => {
                assert_eq!(got, expected, "{var}={value:?}: {reason}");
            }
            other => panic!("{var}={value:?}: expected BadEnv, got {other:?}"),
        }
    }
    assert!(matches!(
        with("LOCAL_RANK", Some("-1")),
        Err(RendezvousError::BadEnv {
            var: "LOCAL_RANK",
            ..
        })
    ));
}
