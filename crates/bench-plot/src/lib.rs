//! The benchmarks' plots, as SVG text: the all-reduce time per call of each
//! path against the message size, with the tuner's ranges shaded where
//! they are given ([`all_reduce_time`]); the bus bandwidth of the
//! NCCL-path collectives beside raw NCCL's ([`bus_bandwidth`]); the
//! rendezvous store's time to barrier against the ranks, one line per
//! server ([`store_barrier`]). The benches (`bench-tables`, the
//! `one_shot_local` bench) and xtask (`cargo xtask plot`) draw through
//! here, so every plot of the project looks the same.
//!
//! Drawing is plotters' SVG backend alone: text is laid out from a size
//! estimate and rendered by the viewer's font, so no font file or system
//! library is read (decision 0018).
//!
//! Invariants:
//! - Both axes are logarithmic and drawn in log space (log2 for bytes and
//!   ranks, log10 for times and bandwidths): a value's position is linear
//!   in its logarithm, and every tick is an exact power (bytes, ranks) or
//!   1, 2 and 5 times a power of ten. A point that is not finite and
//!   positive cannot be placed and is left out.
//! - Every axis label names its unit; the title names the machine and the
//!   date ([`Meta`]); every series and every shaded range is in the legend.
//! - A series' colour follows its path, collective or server, its dash
//!   pattern its mode or source, in the order they first appear.
//! - Nothing here reads or writes files: the callers place the SVG beside
//!   the table it draws.

use plotters::prelude::*;

/// Width and height of every plot, in pixels.
const SIZE: (u32, u32) = (960, 600);

/// A series' colours, in order of first appearance.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Dash patterns (dash, gap in pixels; `None` solid), in order of first
/// appearance of a mode or source.
const DASHES: [Option<(u32, u32)>; 4] = [None, Some((10, 6)), Some((3, 4)), Some((18, 4))];

/// What a plot could not draw.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlotError {
    /// No series holds a point that can be placed on log axes.
    #[error("nothing to plot: no finite positive point in {0}")]
    Empty(&'static str),
    /// plotters refused to draw.
    #[error("drawing the plot: {0}")]
    Draw(String),
}

impl<E: std::error::Error + Send + Sync> From<DrawingAreaErrorKind<E>> for PlotError {
    fn from(e: DrawingAreaErrorKind<E>) -> PlotError {
        PlotError::Draw(e.to_string())
    }
}

/// Where and when the numbers were taken, for the title.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    /// The machine, in words (`2 × NVIDIA H200`).
    pub machine: String,
    /// The date of the run (`YYYY-MM-DD`).
    pub date: String,
}

/// One all-reduce path in one mode: time per call by message size.
#[derive(Debug, Clone, PartialEq)]
pub struct PathSeries {
    /// The path (`NCCL`, `fast path`, `one-shot`): the line's colour.
    pub path: String,
    /// The mode (`eager`, `graph`): the line's dash pattern.
    pub mode: String,
    /// (payload bytes, µs per call).
    pub points: Vec<(u64, f64)>,
}

/// A range the tuner chose: `(min_bytes, max_bytes, path, mode)`, both
/// ends included; shaded in the path's colour.
pub type TunedRange<'a> = (u64, u64, &'a str, &'a str);

/// One collective's bus bandwidth by message size, from one source.
#[derive(Debug, Clone, PartialEq)]
pub struct BwSeries {
    /// The collective (`all_reduce`): the line's colour.
    pub collective: String,
    /// Who ran it (`ours`, `raw NCCL`), with the mode where several are
    /// drawn (`ours, graph`): the line's dash pattern.
    pub source: String,
    /// (payload bytes, bus bandwidth in GB/s, 1 GB = 1e9 bytes).
    pub points: Vec<(u64, f64)>,
}

/// One store server's time to barrier by the number of ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreSeries {
    /// The server (`metrale`, `PyTorch 2.11 libuv`).
    pub server: String,
    /// (ranks, seconds from the ranks' release to the last past the
    /// barrier).
    pub points: Vec<(u64, f64)>,
}

/// All-reduce time per call against message size, log-log, one line per
/// path and mode, `tuned` ranges shaded behind them.
pub fn all_reduce_time(
    meta: &Meta,
    series: &[PathSeries],
    tuned: &[TunedRange<'_>],
) -> Result<String, PlotError> {
    let lines: Vec<Line> = series
        .iter()
        .map(|s| Line {
            label: format!("{}, {}", s.path, s.mode),
            color_key: s.path.clone(),
            dash_key: s.mode.clone(),
            points: bytes_points(&s.points),
        })
        .collect();
    let bands = tuned
        .iter()
        .map(|&(lo, hi, path, mode)| Band {
            label: format!("tuned: {path}, {mode}"),
            color_key: path.to_owned(),
            lo: lo.max(1) as f64,
            hi: hi.max(1) as f64,
        })
        .collect();
    draw(Chart {
        title: format!("All-reduce time per call: {}, {}", meta.machine, meta.date),
        x: Scale::Bytes,
        y: Scale::Decimal,
        x_label: "message size (bytes, log scale)",
        y_label: "time per call (µs, log scale)",
        what: "the all-reduce series",
        lines,
        bands,
    })
}

/// Bus bandwidth against message size, log-log: each collective's sources
/// (ours and raw NCCL) in its colour.
pub fn bus_bandwidth(meta: &Meta, series: &[BwSeries]) -> Result<String, PlotError> {
    let lines = series
        .iter()
        .map(|s| Line {
            label: format!("{}, {}", s.collective, s.source),
            color_key: s.collective.clone(),
            dash_key: s.source.clone(),
            points: bytes_points(&s.points),
        })
        .collect();
    draw(Chart {
        title: format!("Bus bandwidth: {}, {}", meta.machine, meta.date),
        x: Scale::Bytes,
        y: Scale::Decimal,
        x_label: "message size (bytes, log scale)",
        y_label: "bus bandwidth (GB/s, 1 GB = 1e9 B, log scale)",
        what: "the bandwidth series",
        lines,
        bands: Vec::new(),
    })
}

/// The store's time to barrier against the ranks, log-log, one line per
/// server.
pub fn store_barrier(meta: &Meta, series: &[StoreSeries]) -> Result<String, PlotError> {
    let lines = series
        .iter()
        .map(|s| Line {
            label: s.server.clone(),
            color_key: s.server.clone(),
            dash_key: String::new(),
            points: s.points.iter().map(|&(n, t)| (n as f64, t)).collect(),
        })
        .collect();
    draw(Chart {
        title: format!(
            "Rendezvous store, time to barrier: {}, {}",
            meta.machine, meta.date
        ),
        x: Scale::Count,
        y: Scale::Decimal,
        x_label: "ranks (processes' threads, log scale)",
        y_label: "time to barrier (s, log scale)",
        what: "the store series",
        lines,
        bands: Vec::new(),
    })
}

/// `unix` seconds as a UTC date, `YYYY-MM-DD`.
pub fn date_utc(unix: u64) -> String {
    // Days to a civil date (Howard Hinnant's algorithm), in i64.
    let z = (unix / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// A byte count as the tables print it: `8 B`, `32 KiB`, `1 GiB`.
pub fn human_bytes(b: u64) -> String {
    for (shift, suffix) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{} {suffix}", b >> shift);
        }
    }
    format!("{b} B")
}

fn bytes_points(points: &[(u64, f64)]) -> Vec<(f64, f64)> {
    points.iter().map(|&(b, v)| (b as f64, v)).collect()
}

/// How an axis is spaced and labelled.
#[derive(Clone, Copy)]
enum Scale {
    /// log2; ticks at powers of two, labelled as byte counts.
    Bytes,
    /// log2; ticks at powers of two, labelled as counts (`16,384`).
    Count,
    /// log10; ticks at 1, 2 and 5 times powers of ten.
    Decimal,
}

impl Scale {
    fn to_log(self, v: f64) -> f64 {
        match self {
            Scale::Bytes | Scale::Count => v.log2(),
            Scale::Decimal => v.log10(),
        }
    }

    fn unlog(self, l: f64) -> f64 {
        match self {
            Scale::Bytes | Scale::Count => l.exp2(),
            Scale::Decimal => 10f64.powf(l),
        }
    }

    /// The axis' range and ticks (in log space) around values spanning
    /// `lo..=hi` (log space).
    fn axis(self, lo: f64, hi: f64) -> (f64, f64, Vec<f64>) {
        let (mut a, mut b) = (lo.floor(), hi.ceil());
        if b - a < 1.0 {
            a -= 1.0;
            b += 1.0;
        }
        let mut ticks = Vec::new();
        match self {
            Scale::Bytes | Scale::Count => {
                // Powers divisible by the step: 1 KiB and 1 MiB are ticks.
                let step = match b - a {
                    s if s <= 10.0 => 1.0,
                    s if s <= 28.0 => 2.0,
                    _ => 5.0,
                };
                let mut t = (a / step).ceil() * step;
                while t <= b {
                    ticks.push(t);
                    t += step;
                }
            }
            Scale::Decimal => {
                let fine = b - a <= 2.0;
                let mut k = a;
                while k <= b {
                    ticks.push(k);
                    if fine && k < b {
                        ticks.extend([k + 2f64.log10(), k + 5f64.log10()]);
                    }
                    k += 1.0;
                }
            }
        }
        // Room beside the end ticks of a base-2 axis, whose labels are
        // wide and whose data often sits on them.
        let pad = match self {
            Scale::Bytes | Scale::Count => 0.3,
            Scale::Decimal => 0.0,
        };
        (a - pad, b + pad, ticks)
    }

    fn label(self, l: f64) -> String {
        let v = self.unlog(l);
        match self {
            Scale::Bytes => human_bytes(v.round() as u64),
            Scale::Count => thousands(v.round() as u64),
            Scale::Decimal => decimal(v),
        }
    }
}

/// `16384` as `16,384`.
fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A tick value: whole numbers from 1 up, otherwise up to 4 decimals
/// without trailing zeros.
fn decimal(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// A linear coordinate over log-space values with the ticks given: the
/// grid and the labels are at `ticks` only.
#[derive(Clone)]
struct Ticks {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
}

impl Ranged for Ticks {
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let f = (v - self.lo) / (self.hi - self.lo);
        limit.0 + (f * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<H: plotters::coord::ranged1d::KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

struct Line {
    label: String,
    color_key: String,
    dash_key: String,
    points: Vec<(f64, f64)>,
}

struct Band {
    label: String,
    color_key: String,
    lo: f64,
    hi: f64,
}

struct Chart {
    title: String,
    x: Scale,
    y: Scale,
    x_label: &'static str,
    y_label: &'static str,
    what: &'static str,
    lines: Vec<Line>,
    bands: Vec<Band>,
}

/// The index of `key` in `keys`, added at the end when new.
fn key_index(keys: &mut Vec<String>, key: &str) -> usize {
    match keys.iter().position(|k| k == key) {
        Some(i) => i,
        None => {
            keys.push(key.to_owned());
            keys.len() - 1
        }
    }
}

fn placeable(p: &(f64, f64)) -> bool {
    p.0.is_finite() && p.1.is_finite() && p.0 > 0.0 && p.1 > 0.0
}

fn draw(chart: Chart) -> Result<String, PlotError> {
    let Chart {
        title,
        x,
        y,
        x_label,
        y_label,
        what,
        lines,
        bands,
    } = chart;
    // Every line's points in log space, the unplaceable left out.
    let logged: Vec<Vec<(f64, f64)>> = lines
        .iter()
        .map(|l| {
            l.points
                .iter()
                .filter(|p| placeable(p))
                .map(|&(a, b)| (x.to_log(a), y.to_log(b)))
                .collect()
        })
        .collect();
    let all = || logged.iter().flatten();
    let (Some(x_lo), Some(x_hi), Some(y_lo), Some(y_hi)) = (
        all().map(|p| p.0).reduce(f64::min),
        all().map(|p| p.0).reduce(f64::max),
        all().map(|p| p.1).reduce(f64::min),
        all().map(|p| p.1).reduce(f64::max),
    ) else {
        return Err(PlotError::Empty(what));
    };
    let (xa, xb, x_ticks) = x.axis(x_lo, x_hi);
    let (ya, yb, y_ticks) = y.axis(y_lo, y_hi);
    // The lines' colours first, so a range shares its path's colour and a
    // range of a path not drawn takes the next one.
    let mut colors = Vec::new();
    for l in &lines {
        key_index(&mut colors, &l.color_key);
    }
    let mut dashes = Vec::new();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut c = ChartBuilder::on(&root)
            .caption(&title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(56)
            .y_label_area_size(76)
            .build_cartesian_2d(
                Ticks {
                    lo: xa,
                    hi: xb,
                    ticks: x_ticks,
                },
                Ticks {
                    lo: ya,
                    hi: yb,
                    ticks: y_ticks,
                },
            )?;
        c.configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .x_label_formatter(&|v| x.label(*v))
            .y_label_formatter(&|v| y.label(*v))
            .bold_line_style(BLACK.mix(0.12))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .draw()?;
        for b in &bands {
            let color = PALETTE[key_index(&mut colors, &b.color_key) % PALETTE.len()];
            let (lo, hi) = (x.to_log(b.lo).max(xa), x.to_log(b.hi).min(xb));
            if lo > hi {
                continue;
            }
            c.draw_series(std::iter::once(Rectangle::new(
                [(lo, ya), (hi, yb)],
                color.mix(0.15).filled(),
            )))?
            .label(b.label.as_str())
            .legend(move |(px, py)| {
                Rectangle::new([(px, py - 6), (px + 18, py + 6)], color.mix(0.3).filled())
            });
        }
        for (l, pts) in lines.iter().zip(&logged) {
            let color = PALETTE[key_index(&mut colors, &l.color_key) % PALETTE.len()];
            let dash = DASHES[key_index(&mut dashes, &l.dash_key) % DASHES.len()];
            let style = color.stroke_width(2);
            let drawn = match dash {
                None => c.draw_series(LineSeries::new(pts.iter().copied(), style))?,
                Some((on, off)) => {
                    c.draw_series(DashedLineSeries::new(pts.iter().copied(), on, off, style))?
                }
            };
            drawn.label(l.label.as_str()).legend(move |(px, py)| {
                let (on, off) = dash.map_or((9, 0), |(a, b)| (a.min(8) as i32, b as i32));
                EmptyElement::at((px, py))
                    + PathElement::new(vec![(0, 0), (on, 0)], style)
                    + PathElement::new(vec![(on + off, 0), (18.max(2 * on + off), 0)], style)
            });
            c.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
        c.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.4))
            .label_font(("sans-serif", 14))
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}
