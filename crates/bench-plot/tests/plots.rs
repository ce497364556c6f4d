//! Each plot drawn from fixed data, its SVG read back: every series and
//! shaded range named in the legend, both axes labelled with their units,
//! the machine and date in the title, and points where the data puts them
//! (on a tick exactly, and between two ticks at the log-scale position).
//! `BENCH_PLOT_KEEP=DIR` keeps the SVGs there to look at.

use bench_plot::{BwSeries, Meta, PathSeries, StoreSeries, TunedRange};

fn meta() -> Meta {
    Meta {
        machine: "2 × NVIDIA H200".into(),
        date: "2026-12-04".into(),
    }
}

fn keep(name: &str, svg: &str) {
    if let Some(dir) = std::env::var_os("BENCH_PLOT_KEEP") {
        std::fs::write(std::path::Path::new(&dir).join(name), svg).unwrap();
    }
}

/// The value of attribute `name` in one tag's text.
fn attr(tag: &str, name: &str) -> Option<f64> {
    let key = format!(" {name}=\"");
    let start = tag.find(&key)? + key.len();
    let end = start + tag[start..].find('"')?;
    tag[start..end].parse().ok()
}

/// Every `<text>` element: (x, y, its text).
fn texts(svg: &str) -> Vec<(f64, f64, String)> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| {
            let open_end = t.find('>')?;
            let close = t.find("</text>")?;
            let tag = &t[..open_end];
            Some((
                attr(tag, "x")?,
                attr(tag, "y")?,
                t[open_end + 1..close].trim().to_owned(),
            ))
        })
        .collect()
}

/// Every marker circle's centre.
fn circles(svg: &str) -> Vec<(f64, f64)> {
    svg.split("<circle")
        .skip(1)
        .filter_map(|t| {
            let tag = &t[..t.find('>')?];
            Some((attr(tag, "cx")?, attr(tag, "cy")?))
        })
        .collect()
}

/// The position of the tick label `label`: x for the x axis (labels sit
/// below their tick, centred), y for the y axis (right of it, centred).
fn tick(svg: &str, label: &str, x_axis: bool) -> f64 {
    let found: Vec<_> = texts(svg).into_iter().filter(|t| t.2 == label).collect();
    assert_eq!(found.len(), 1, "one tick label `{label}`: {found:?}");
    if x_axis { found[0].0 } else { found[0].1 }
}

fn has_text(svg: &str, want: &str) -> bool {
    texts(svg).iter().any(|t| t.2 == want)
}

/// Whether a marker sits at (x, y), within a pixel.
fn marker_at(svg: &str, x: f64, y: f64) -> bool {
    circles(svg)
        .iter()
        .any(|&(cx, cy)| (cx - x).abs() <= 1.0 && (cy - y).abs() <= 1.0)
}

fn common_checks(svg: &str, title_start: &str, x_unit: &str, y_unit: &str) {
    assert!(svg.starts_with("<svg"), "{}", &svg[..100.min(svg.len())]);
    let title = texts(svg)
        .into_iter()
        .find(|t| t.2.starts_with(title_start))
        .unwrap_or_else(|| panic!("no title `{title_start}...`"));
    assert!(
        title.2.contains("2 × NVIDIA H200") && title.2.contains("2026-12-04"),
        "the title names the machine and date: {}",
        title.2
    );
    assert!(
        texts(svg).iter().any(|t| t.2.contains(x_unit)),
        "x axis label with `{x_unit}`"
    );
    assert!(
        texts(svg).iter().any(|t| t.2.contains(y_unit)),
        "y axis label with `{y_unit}`"
    );
}

#[test]
fn all_reduce_time_per_path_with_tuned_ranges() {
    let series = vec![
        PathSeries {
            path: "NCCL".into(),
            mode: "eager".into(),
            points: vec![(8, 12.0), (1024, 10.0), (2048, 12.5), (1 << 20, 14.0)],
        },
        PathSeries {
            path: "fast path".into(),
            mode: "eager".into(),
            points: vec![(8, 20.0), (1 << 20, 15.0), (2 << 20, 22.0)],
        },
        PathSeries {
            path: "one-shot".into(),
            mode: "graph".into(),
            points: vec![(8, 2.9), (64 << 10, 3.4), (1 << 20, 5.9)],
        },
        PathSeries {
            path: "NCCL".into(),
            mode: "graph".into(),
            points: vec![(8, 5.9), (1 << 20, 13.9), (4 << 20, 31.6)],
        },
    ];
    let tuned: Vec<TunedRange<'_>> = vec![
        (8, 1 << 20, "one-shot", "graph"),
        (2 << 20, 4 << 20, "fast path", "eager"),
    ];
    let svg = bench_plot::all_reduce_time(&meta(), &series, &tuned).unwrap();
    keep("all-reduce.svg", &svg);
    common_checks(&svg, "All-reduce time per call", "(bytes", "(µs");
    for name in [
        "NCCL, eager",
        "fast path, eager",
        "one-shot, graph",
        "NCCL, graph",
    ] {
        assert!(has_text(&svg, name), "legend: {name}");
    }
    for name in ["tuned: one-shot, graph", "tuned: fast path, eager"] {
        assert!(has_text(&svg, name), "legend: {name}");
    }
    // 8 B to 4 MiB: ticks every factor 4 from 8 B (2^3 .. 2^22).
    let (x_1k, x_4k) = (tick(&svg, "1 KiB", true), tick(&svg, "4 KiB", true));
    let (y_10, y_20) = (tick(&svg, "10", false), tick(&svg, "20", false));
    // (1 KiB, 10 µs) sits on both ticks.
    assert!(
        marker_at(&svg, x_1k, y_10),
        "(1 KiB, 10 µs) at ({x_1k}, {y_10}): {:?}",
        circles(&svg)
    );
    // 2 KiB is halfway between 1 and 4 KiB on a log scale (a third of the
    // way on a linear one); 12.5 µs is log10(1.25)/log10(2) = 0.32 of the
    // way from 10 to 20.
    let x_2k = (x_1k + x_4k) / 2.0;
    let y_12_5 = y_10 + (y_20 - y_10) * (1.25f64.log10() / 2f64.log10());
    assert!(
        marker_at(&svg, x_2k, y_12_5),
        "(2 KiB, 12.5 µs) at ({x_2k}, {y_12_5}): {:?}",
        circles(&svg)
    );
    assert!(!marker_at(&svg, x_1k + (x_4k - x_1k) / 3.0, y_12_5));
    // Every point is a marker: 4 + 3 + 3 + 3.
    assert_eq!(circles(&svg).len(), 13);
}

#[test]
fn bus_bandwidth_ours_beside_raw() {
    let gbs = |bytes: u64, us: f64| bytes as f64 / us / 1e3;
    let sizes = [1u64 << 20, 16 << 20, 256 << 20, 1 << 30];
    let times = [14.0, 70.0, 850.0, 3280.0];
    let pts = |scale: f64| -> Vec<(u64, f64)> {
        sizes
            .iter()
            .zip(times)
            .map(|(&b, t)| (b, gbs(b, t * scale)))
            .collect()
    };
    let series = vec![
        BwSeries {
            collective: "all_reduce".into(),
            source: "ours".into(),
            points: pts(1.01),
        },
        BwSeries {
            collective: "all_reduce".into(),
            source: "raw NCCL".into(),
            points: pts(1.0),
        },
        BwSeries {
            collective: "all_gather".into(),
            source: "ours".into(),
            points: pts(0.6),
        },
        BwSeries {
            collective: "all_gather".into(),
            source: "raw NCCL".into(),
            points: pts(0.6),
        },
    ];
    let svg = bench_plot::bus_bandwidth(&meta(), &series).unwrap();
    keep("busbw.svg", &svg);
    common_checks(&svg, "Bus bandwidth", "(bytes", "(GB/s");
    for name in [
        "all_reduce, ours",
        "all_reduce, raw NCCL",
        "all_gather, ours",
        "all_gather, raw NCCL",
    ] {
        assert!(has_text(&svg, name), "legend: {name}");
    }
    // 1 GiB in 3280 µs is 327.4 GB/s: between the 200 and 500 ticks at
    // log10(327.4 / 200) / log10(2.5) of the way.
    let x = tick(&svg, "1 GiB", true);
    let (y200, y500) = (tick(&svg, "200", false), tick(&svg, "500", false));
    let y = y200 + (y500 - y200) * ((gbs(1 << 30, 3280.0) / 200.0).log10() / 2.5f64.log10());
    assert!(
        marker_at(&svg, x, y),
        "(1 GiB, 327 GB/s) at ({x}, {y}): {:?}",
        circles(&svg)
    );
}

#[test]
fn store_time_to_barrier_ours_beside_pytorch() {
    let series = vec![
        StoreSeries {
            server: "metrale".into(),
            points: vec![(1024, 0.17), (4096, 0.42), (16384, 3.45)],
        },
        StoreSeries {
            server: "PyTorch 2.11 libuv".into(),
            points: vec![(1024, 0.2), (4096, 0.40), (16384, 2.45)],
        },
    ];
    let svg = bench_plot::store_barrier(&meta(), &series).unwrap();
    keep("store.svg", &svg);
    common_checks(&svg, "Rendezvous store", "ranks", "(s,");
    assert!(has_text(&svg, "metrale") && has_text(&svg, "PyTorch 2.11 libuv"));
    // PyTorch at 1,024 ranks took 0.2 s: both on ticks.
    let (x, y) = (tick(&svg, "1,024", true), tick(&svg, "0.2", false));
    assert!(
        marker_at(&svg, x, y),
        "(1,024, 0.2 s) at ({x}, {y}): {:?}",
        circles(&svg)
    );
    assert_eq!(circles(&svg).len(), 6);
}

#[test]
fn nothing_placeable_is_an_error_and_dates_are_civil() {
    let bad = [StoreSeries {
        server: "x".into(),
        points: vec![(0, 1.0), (4, f64::NAN), (8, -1.0)],
    }];
    let e = bench_plot::store_barrier(&meta(), &bad).unwrap_err();
    assert!(e.to_string().contains("nothing to plot"), "{e}");
    assert_eq!(bench_plot::date_utc(0), "1970-01-01");
    assert_eq!(bench_plot::date_utc(1_796_400_000), "2026-12-04");
    assert_eq!(bench_plot::date_utc(951_782_400), "2000-02-29");
    assert_eq!(bench_plot::human_bytes(3 << 20), "3 MiB");
    assert_eq!(bench_plot::human_bytes(1000), "1000 B");
}
