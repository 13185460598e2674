//! Charts of a run (SVG and PNG through plotters): per-step RSS and step time, one line per
//! series, two panels. The PNG's text uses DejaVu Sans, shipped in `native-cli/assets` (license
//! beside it), so no system font library is needed.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

/// One line: a name and (step, value) points.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// (step, RSS MiB) points.
    pub rss_mib: Vec<(f64, f64)>,
    /// (step, step time ms) points.
    pub step_ms: Vec<(f64, f64)>,
}

/// A horizontal reference line on the RSS panel (the plan's prediction).
#[derive(Debug, Clone)]
pub struct Reference {
    /// Legend text.
    pub name: String,
    /// MiB.
    pub mib: f64,
}

const FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");
const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // A bundled, valid font: registration cannot fail at run time.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// From 0 to a little above the largest value: a flat line looks flat.
fn range(points: impl Iterator<Item = f64>) -> (f64, f64) {
    let hi = points.fold(0f64, f64::max);
    (0.0, if hi > 0.0 { hi * 1.2 } else { 1.0 })
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    caption: &str,
    y_label: &str,
    series: &[Series],
    pick: fn(&Series) -> &[(f64, f64)],
    reference: Option<&Reference>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let steps = series
        .iter()
        .flat_map(|s| pick(s).iter().map(|p| p.0))
        .fold(1.0f64, f64::max);
    let (lo, hi) = range(
        series
            .iter()
            .flat_map(|s| pick(s).iter().map(|p| p.1))
            .chain(reference.map(|r| r.mib)),
    );
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..steps + 1.0, lo..hi)
        .map_err(|e| anyhow!("chart: {e}"))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_label)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("chart: {e}"))?;
    if let Some(r) = reference {
        let grey = RGBColor(120, 120, 120);
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, r.mib), (steps + 1.0, r.mib)],
                8,
                6,
                grey.stroke_width(2),
            ))
            .map_err(|e| anyhow!("chart: {e}"))?
            .label(r.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], grey.stroke_width(2))
            });
    }
    for (i, s) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pick(s).iter().copied(), c.stroke_width(2)))
            .map_err(|e| anyhow!("chart: {e}"))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("chart: {e}"))?;
    Ok(())
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    series: &[Series],
    reference: Option<&Reference>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(|e| anyhow!("chart: {e}"))?;
    let root = root
        .titled(title, ("sans-serif", 26))
        .map_err(|e| anyhow!("chart: {e}"))?;
    let (top, bottom) = root.split_vertically(root.dim_in_pixel().1 / 2);
    panel(
        &top,
        "resident memory (RSS)",
        "MiB",
        series,
        |s| &s.rss_mib,
        reference,
    )?;
    panel(&bottom, "time per step", "ms", series, |s| &s.step_ms, None)?;
    root.present().map_err(|e| anyhow!("chart: {e}"))?;
    Ok(())
}

/// Writes `stem.svg` and `stem.png`; returns their paths.
pub fn write(
    stem: &Path,
    title: &str,
    series: &[Series],
    reference: Option<&Reference>,
) -> Result<(std::path::PathBuf, std::path::PathBuf)> {
    register_font();
    let svg = stem.with_extension("svg");
    let png = stem.with_extension("png");
    draw(
        SVGBackend::new(&svg, (1000, 760)).into_drawing_area(),
        title,
        series,
        reference,
    )?;
    draw(
        BitMapBackend::new(&png, (1000, 760)).into_drawing_area(),
        title,
        series,
        reference,
    )?;
    Ok((svg, png))
}
