//! Launcher detection (`rendezvous::Launch`) from fake environments: every
//! launcher, the precedence between them, and missing or contradictory
//! values, each a `LaunchError` that names the launcher and lists what was
//! found. The process environment is never read or changed here.

use std::collections::HashMap;

use metrale_rendezvous::{DEVICE_ENV, Launch, LaunchError, Launcher, RendezvousError, StoreRole};

fn launch(vars: &[(&str, &str)]) -> Result<Launch, RendezvousError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    Launch::from_lookup(move |k| map.get(k).cloned())
}

fn ok(vars: &[(&str, &str)]) -> Launch {
    launch(vars).unwrap_or_else(|e| panic!("{vars:?}: {e}"))
}

/// The error of `vars`, checked to come from `launcher` and to mention
/// every string of `says`.
fn bad(vars: &[(&str, &str)], launcher: &str, says: &[&str]) -> LaunchError {
    match launch(vars) {
        Err(RendezvousError::Launch(e)) => {
            let text = e.to_string();
            assert_eq!(e.launcher, launcher, "{text}");
            for s in says {
                assert!(text.contains(s), "{text:?} does not mention {s:?}");
            }
            e
        }
        other => panic!("{vars:?}: expected a LaunchError, got {other:?}"),
    }
}

fn with<'a>(
    base: &[(&'a str, &'a str)],
    changes: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    let mut v: Vec<(&str, &str)> = base
        .iter()
        .copied()
        .filter(|(k, _)| !changes.iter().any(|(c, _)| c == k))
        .collect();
    v.extend(changes.iter().copied().filter(|(_, val)| *val != "<unset>"));
    v
}

const TORCHRUN: &[(&str, &str)] = &[
    ("RANK", "5"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_RANK", "1"),
    ("LOCAL_WORLD_SIZE", "4"),
    ("GROUP_RANK", "1"),
    ("MASTER_ADDR", "node0"),
    ("MASTER_PORT", "29400"),
    ("TORCHELASTIC_RUN_ID", "job-42"),
    ("TORCHELASTIC_RESTART_COUNT", "2"),
    ("TORCHELASTIC_USE_AGENT_STORE", "True"),
];

#[test]
fn torchrun() {
    let l = ok(TORCHRUN);
    assert_eq!(l.launcher, Launcher::Torchrun);
    assert_eq!((l.rank, l.world_size), (5, 8));
    assert_eq!((l.local_rank, l.local_world_size), (Some(1), Some(4)));
    assert_eq!((l.device, l.device_from), (1, "LOCAL_RANK"));
    assert_eq!((l.master_addr.as_str(), l.master_port), ("node0", 29400));
    assert_eq!(l.store, StoreRole::Launcher);
    assert_eq!(l.namespace, "metrale/job-42/attempt_2/");
    // Without the agent store rank 0 serves, as torch's own env:// would.
    let own = ok(&with(
        TORCHRUN,
        &[("TORCHELASTIC_USE_AGENT_STORE", "False")],
    ));
    assert_eq!(own.store, StoreRole::Rank0);
    let own = ok(&with(
        TORCHRUN,
        &[("TORCHELASTIC_USE_AGENT_STORE", "<unset>")],
    ));
    assert_eq!(own.store, StoreRole::Rank0);
    // The device is checked against LOCAL_WORLD_SIZE, not WORLD_SIZE.
    bad(
        &with(TORCHRUN, &[("LOCAL_RANK", "4")]),
        "torchrun",
        &[
            "LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4",
            "TORCHELASTIC_RUN_ID=job-42 (torchrun)",
        ],
    );
    bad(
        &with(TORCHRUN, &[("LOCAL_WORLD_SIZE", "9")]),
        "torchrun",
        &["LOCAL_WORLD_SIZE=9"],
    );
    bad(
        &with(TORCHRUN, &[("LOCAL_WORLD_SIZE", "<unset>")]),
        "torchrun",
        &["LOCAL_WORLD_SIZE is not set"],
    );
    bad(
        &with(TORCHRUN, &[("RANK", "8")]),
        "torchrun",
        &["RANK=8 is not below WORLD_SIZE=8"],
    );
    bad(
        &with(TORCHRUN, &[("MASTER_PORT", "0")]),
        "torchrun",
        &["MASTER_PORT"],
    );
    bad(
        &with(TORCHRUN, &[("MASTER_ADDR", "  ")]),
        "torchrun",
        &["MASTER_ADDR is not set"],
    );
    bad(
        &with(TORCHRUN, &[("TORCHELASTIC_RESTART_COUNT", "x")]),
        "torchrun",
        &["TORCHELASTIC_RESTART_COUNT"],
    );
    // One explicit override of the device, which torchrun's bound does not apply to.
    let l = ok(&with(TORCHRUN, &[(DEVICE_ENV, "6")]));
    assert_eq!((l.device, l.device_from), (6, DEVICE_ENV));
    bad(
        &with(TORCHRUN, &[(DEVICE_ENV, "gpu1")]),
        "torchrun",
        &[DEVICE_ENV],
    );
    // mpirun starting one torchrun per node: torchrun's values win, and the
    // MPI ones (the node's) are no contradiction.
    let l = ok(&with(
        TORCHRUN,
        &[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")],
    ));
    assert_eq!((l.launcher, l.rank), (Launcher::Torchrun, 5));
}

const ENV: &[(&str, &str)] = &[
    ("RANK", "2"),
    ("WORLD_SIZE", "4"),
    ("LOCAL_RANK", "0"),
    ("MASTER_ADDR", "10.0.0.1"),
    ("MASTER_PORT", "29500"),
];

#[test]
fn explicit_variables() {
    let l = ok(ENV);
    assert_eq!(l.launcher, Launcher::Env);
    assert_eq!((l.rank, l.world_size, l.device), (2, 4, 0));
    assert_eq!(l.store, StoreRole::Rank0);
    assert_eq!(l.namespace, "metrale/");
    // One machine: LOCAL_RANK defaults to RANK.
    let l = ok(&with(ENV, &[("LOCAL_RANK", "<unset>")]));
    assert_eq!((l.device, l.device_from), (2, "RANK (no LOCAL_RANK)"));
    bad(
        &with(ENV, &[("MASTER_ADDR", "<unset>")]),
        "environment",
        &["MASTER_ADDR is not set"],
    );
    bad(
        &with(ENV, &[("MASTER_PORT", "70000")]),
        "environment",
        &["MASTER_PORT"],
    );
    bad(
        &with(ENV, &[("WORLD_SIZE", "0")]),
        "environment",
        &["WORLD_SIZE is 0"],
    );
    bad(
        &with(ENV, &[("WORLD_SIZE", "<unset>")]),
        "environment",
        &["WORLD_SIZE is not set"],
    );
    bad(
        &with(ENV, &[("RANK", "-1")]),
        "environment",
        &["RANK=\"-1\""],
    );
    // A value another launcher gives too must agree (a stale RANK under mpirun).
    bad(
        &with(ENV, &[("OMPI_COMM_WORLD_RANK", "3")]),
        "environment",
        &[
            "RANK=2 contradicts OMPI_COMM_WORLD_RANK=3",
            "OMPI_COMM_WORLD_RANK=3 (open mpi)",
        ],
    );
    bad(
        &with(ENV, &[("PMI_SIZE", "8")]),
        "environment",
        &["WORLD_SIZE=4 contradicts PMI_SIZE=8"],
    );
    // Slurm's values describe the job step and are never a contradiction.
    let l = ok(&with(ENV, &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]));
    assert_eq!((l.launcher, l.rank), (Launcher::Env, 2));
    // Empty values count as unset.
    let l = ok(&with(
        ENV,
        &[("LOCAL_RANK", ""), ("OMPI_COMM_WORLD_RANK", "")],
    ));
    assert_eq!(l.device, 2);
}

#[test]
fn kubeflow() {
    let vars = with(
        ENV,
        &[
            ("LOCAL_RANK", "<unset>"),
            ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
        ],
    );
    let l = ok(&vars);
    assert_eq!(l.launcher, Launcher::Kubeflow);
    assert_eq!((l.rank, l.world_size), (2, 4));
    assert_eq!((l.device, l.local_world_size), (0, Some(1)));
    assert_eq!(l.store, StoreRole::Rank0);
    // With LOCAL_RANK it is plain variables, even in Kubernetes.
    let l = ok(&with(ENV, &[("KUBERNETES_SERVICE_HOST", "10.96.0.1")]));
    assert_eq!(l.launcher, Launcher::Env);
    bad(
        &with(&vars, &[("MASTER_PORT", "<unset>")]),
        "kubeflow",
        &["MASTER_PORT is not set"],
    );
}

const SLURM: &[(&str, &str)] = &[
    ("SLURM_PROCID", "5"),
    ("SLURM_NTASKS", "8"),
    ("SLURM_LOCALID", "1"),
    ("SLURM_JOB_NODELIST", "gpu[01-04,07],login1"),
    ("SLURM_JOB_ID", "123456"),
];

#[test]
fn slurm() {
    let l = ok(SLURM);
    assert_eq!(l.launcher, Launcher::Slurm);
    assert_eq!((l.rank, l.world_size, l.device), (5, 8, 1));
    assert_eq!((l.master_addr.as_str(), l.master_port), ("gpu01", 29956));
    assert_eq!(l.store, StoreRole::Rank0);
    let l = ok(&with(SLURM, &[("SLURM_STEP_NODELIST", "gpu[03-04]")]));
    assert_eq!(l.master_addr, "gpu03");
    let l = ok(&with(
        SLURM,
        &[("MASTER_ADDR", "head"), ("MASTER_PORT", "1234")],
    ));
    assert_eq!((l.master_addr.as_str(), l.master_port), ("head", 1234));
    let l = ok(&with(SLURM, &[("SLURM_JOB_ID", "<unset>")]));
    assert_eq!(l.master_port, 29500);
    bad(
        &with(SLURM, &[("SLURM_JOB_NODELIST", "gpu[01-")]),
        "slurm",
        &["SLURM_JOB_NODELIST", "'['"],
    );
    bad(
        &with(SLURM, &[("SLURM_JOB_NODELIST", "<unset>")]),
        "slurm",
        &["set MASTER_ADDR"],
    );
    bad(
        &with(SLURM, &[("SLURM_PROCID", "8")]),
        "slurm",
        &["SLURM_PROCID=8 is not below SLURM_NTASKS=8"],
    );
    bad(
        &with(SLURM, &[("SLURM_LOCALID", "<unset>")]),
        "slurm",
        &["SLURM_LOCALID is not set"],
    );
}

const OMPI: &[(&str, &str)] = &[
    ("OMPI_COMM_WORLD_RANK", "3"),
    ("OMPI_COMM_WORLD_SIZE", "4"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ("MASTER_ADDR", "head"),
];

#[test]
fn open_mpi() {
    let l = ok(OMPI);
    assert_eq!(l.launcher, Launcher::OpenMpi);
    assert_eq!((l.rank, l.world_size, l.device), (3, 4, 1));
    assert_eq!((l.master_addr.as_str(), l.master_port), ("head", 29500));
    // Outside Slurm nothing else names the master.
    bad(
        &with(OMPI, &[("MASTER_ADDR", "<unset>")]),
        "open mpi",
        &["no store address"],
    );
    // mpirun inside an allocation: Slurm's first node, and Slurm's own
    // (batch step) values are no contradiction.
    let l = ok(&with(
        OMPI,
        &[
            ("MASTER_ADDR", "<unset>"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_JOB_NODELIST", "n[7-8]"),
            ("SLURM_JOB_ID", "17"),
        ],
    ));
    assert_eq!(
        (l.master_addr.as_str(), l.master_port, l.rank),
        ("n7", 29517, 3)
    );
    bad(
        &with(OMPI, &[("OMPI_COMM_WORLD_LOCAL_RANK", "2")]),
        "open mpi",
        &["is not below OMPI_COMM_WORLD_LOCAL_SIZE=2"],
    );
    bad(
        &with(OMPI, &[("PMIX_RANK", "0")]),
        "open mpi",
        &["contradicts PMIX_RANK=0"],
    );
    bad(
        &with(OMPI, &[("OMPI_COMM_WORLD_SIZE", "<unset>")]),
        "open mpi",
        &["OMPI_COMM_WORLD_SIZE is not set"],
    );
}

#[test]
fn mpich_intel_mpi_and_pmix() {
    let mpich = [
        ("PMI_RANK", "2"),
        ("PMI_SIZE", "4"),
        ("MPI_LOCALRANKID", "0"),
        ("MPI_LOCALNRANKS", "2"),
        ("MASTER_ADDR", "head"),
        ("MASTER_PORT", "4000"),
    ];
    let l = ok(&mpich);
    assert_eq!(l.launcher, Launcher::Mpich);
    assert_eq!(
        (l.rank, l.world_size, l.device, l.master_port),
        (2, 4, 0, 4000)
    );
    bad(
        &with(&mpich, &[("PMIX_RANK", "1")]),
        "mpich/intel mpi",
        &["PMI_RANK=2 contradicts PMIX_RANK=1"],
    );
    bad(
        &with(&mpich, &[("PMI_SIZE", "<unset>")]),
        "mpich/intel mpi",
        &["PMI_SIZE is not set"],
    );
    bad(
        &with(&mpich, &[("MPI_LOCALRANKID", "<unset>")]),
        "mpich/intel mpi",
        &["no local rank", DEVICE_ENV],
    );
    let l = ok(&with(
        &mpich,
        &[("MPI_LOCALRANKID", "<unset>"), (DEVICE_ENV, "3")],
    ));
    assert_eq!(l.device, 3);
    // PMIx under srun: Slurm gives the size and the local rank.
    let pmix = [
        ("PMIX_RANK", "3"),
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_JOB_NODELIST", "a[1-2]"),
    ];
    let l = ok(&pmix);
    assert_eq!(l.launcher, Launcher::Pmix);
    assert_eq!(
        (l.rank, l.world_size, l.device, l.master_addr.as_str()),
        (3, 4, 1, "a1")
    );
    bad(
        &[("PMIX_RANK", "3")],
        "pmix",
        &["PMI_SIZE is not set", "PMIX_RANK=3 (pmix)"],
    );
}

#[test]
fn nothing_or_garbage() {
    let e = bad(
        &[],
        "launcher detection",
        &["no launcher found", "no launcher variable"],
    );
    assert!(e.found.is_empty());
    let e = bad(
        &[("SLURM_PROCID", "x"), ("METRALE_STORE_TOKEN", "secret")],
        "slurm",
        &["SLURM_PROCID=\"x\""],
    );
    assert!(
        !e.to_string().contains("secret"),
        "the token is never listed"
    );
    // The token is kept but never shown.
    let l = ok(&with(ENV, &[("METRALE_STORE_TOKEN", "secret")]));
    assert_eq!(l.token.as_deref(), Some("secret"));
    assert!(!format!("{l:?}").contains("secret"));
}
