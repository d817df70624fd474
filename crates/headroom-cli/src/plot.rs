//! Every picture headroom draws: the stacked component timeline of an estimate, line charts of
//! recorded and simulated timelines and of `fit`'s configurations, a terminal sparkline, and
//! the self-contained HTML page that holds them. SVG through plotters, whose SVG backend
//! writes `<text>` elements, so no font file is read (its `ttf` feature stays off).

use headroom::estimate::Timeline;
use headroom::sim::Component;
use headroom::units::gib;
use plotters::coord::Shift;
use plotters::prelude::*;

const WIDTH: u32 = 1100;
/// The legend's column, right of the chart.
const LEGEND_WIDTH: u32 = 230;
const HEIGHT: u32 = 520;
const GIB: f64 = (1u64 << 30) as f64;

/// Colours of the components, in [`Component::ALL`] order (Tableau 20, readable side by side).
const COMPONENT_COLORS: [RGBColor; Component::COUNT] = [
    RGBColor(0x4e, 0x79, 0xa7), // weights
    RGBColor(0xf2, 0x8e, 0x2b), // gradients
    RGBColor(0x59, 0xa1, 0x4f), // optimizer states
    RGBColor(0x8c, 0xd1, 0x7d), // optimizer-step temporaries
    RGBColor(0xe1, 0x57, 0x59), // activations
    RGBColor(0xb0, 0x7a, 0xa1), // logits and loss
    RGBColor(0x76, 0xb7, 0xb2), // autocast copies
    RGBColor(0xed, 0xc9, 0x48), // LoRA / quantization extras
    RGBColor(0x9c, 0x75, 0x5f), // workspaces
    RGBColor(0xff, 0x9d, 0xa7), // input ids
    RGBColor(0xa0, 0xcb, 0xe8), // communication buffers
    RGBColor(0xba, 0xb0, 0xac), // allocator rounding
];
const RESERVED: RGBColor = RGBColor(0x33, 0x33, 0x33);
const CACHE: RGBColor = RGBColor(0xdd, 0xdd, 0xdd);
const OUTSIDE: RGBColor = RGBColor(0xc5, 0xb0, 0xd5);
const OTHER_MODELS: RGBColor = RGBColor(0x8c, 0x8c, 0x70);
const CAPACITY: RGBColor = RGBColor(0xc0, 0x00, 0x00);

/// What an estimate's picture shows beside its timeline.
pub struct TimelinePlot<'a> {
    pub title: String,
    pub timeline: &'a Timeline,
    /// What the caching allocator may hold on the GPU, and how to name that line.
    pub capacity: Option<(u64, String)>,
    /// What holds the peak: `peak 41.20 GiB (step 1 backward): activations 20.1 GiB, ...`.
    pub peak_label: String,
    /// `step` for a run, `iteration` for a pipeline.
    pub when: &'static str,
    /// Per phase of the timeline, device bytes held outside the caching allocator (a
    /// pipeline's rollout engines while awake); empty: none.
    pub outside: Vec<u64>,
}

/// The estimate's timeline: allocated bytes stacked by component, reserved bytes as a line
/// above (the gap is the allocator's cache), the capacity line, each phase a band, the peak
/// and the out-of-memory point marked.
pub fn timeline_svg(plot: &TimelinePlot) -> String {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        draw_timeline(&root, plot).expect("drawing into a string does not fail");
        root.present().expect("drawing into a string does not fail");
    }
    svg
}

fn draw_timeline(
    root: &DrawingArea<SVGBackend, Shift>,
    plot: &TimelinePlot,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let t = plot.timeline;
    root.fill(&WHITE)?;
    let root = root.titled(&plot.title, ("sans-serif", 18))?;
    let (area, legend_area) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
    let mut legend = Vec::new();
    let top_bytes = t
        .points
        .iter()
        .enumerate()
        .map(|(i, p)| p.reserved.max(p.allocated()) + outside_at(plot, i))
        .chain(plot.capacity.as_ref().map(|c| c.0))
        .max()
        .unwrap_or(0)
        .max(1);
    // Points, not events, along x: a phase of many events (a generation, token by token) is
    // drawn as wide as any other phase that reaches its points.
    let x_max = (t.points.len().max(2) - 1) as f64;
    let y_max = top_bytes as f64 / GIB * 1.12;
    let mut chart = ChartBuilder::on(&area)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(WHITE)
        .x_desc(format!(
            "{} allocations, frees and changes of component in order; a phase's most drawn \
             over at most {} points",
            t.events, t.points_per_phase
        ))
        .y_desc("GiB")
        .y_label_formatter(&|v| gib_tick(*v, y_max))
        .x_labels(0)
        .draw()?;

    // Phases: alternate bands, named where they are wide enough.
    let pixels_per_point = f64::from(WIDTH - LEGEND_WIDTH - 90) / x_max;
    for (i, phase) in t.phases.iter().enumerate() {
        let (a, b) = (
            phase.points.start as f64 - 0.5,
            phase.points.end as f64 - 0.5,
        );
        if i % 2 == 1 {
            chart.draw_series(std::iter::once(Rectangle::new(
                [(a, 0.0), (b, y_max)],
                RGBColor(0xf2, 0xf2, 0xf2).filled(),
            )))?;
        }
        let width = (b - a) * pixels_per_point;
        let long = format!("{} {} {}", plot.when, phase.step, phase.name);
        let label = [long, phase.name.clone()]
            .into_iter()
            .find(|l| width > 5.6 * l.len() as f64);
        if let Some(label) = label {
            chart.draw_series(std::iter::once(Text::new(
                label,
                (a + 2.0 / pixels_per_point, y_max * 0.985),
                ("sans-serif", 11)
                    .into_font()
                    .color(&RGBColor(0x55, 0x55, 0x55)),
            )))?;
        }
    }

    // What the models a phase does not run hold (a pipeline's other instances) at the bottom,
    // then this phase's components stacked in `Component::ALL` order, each drawn where it is
    // ever live.
    let xs: Vec<f64> = (0..t.points.len()).map(|i| i as f64).collect();
    let mut idle = vec![[0u64; Component::COUNT]; t.points.len()];
    for phase in &t.phases {
        for i in phase.points.clone() {
            for c in Component::ALL {
                idle[i][c.index()] = phase.idle[c.index()].min(t.points[i].by_component[c.index()]);
            }
        }
    }
    let own = |i: usize, c: Component| t.points[i].by_component[c.index()] - idle[i][c.index()];
    let mut below = vec![0u64; t.points.len()];
    let mut layers: Vec<(String, RGBColor, Vec<u64>)> = Vec::new();
    if idle.iter().any(|bytes| bytes.iter().any(|&b| b > 0)) {
        let heights = idle.iter().map(|bytes| bytes.iter().sum()).collect();
        layers.push((
            "other models (not run in the phase)".into(),
            OTHER_MODELS,
            heights,
        ));
    }
    for c in Component::ALL {
        let heights: Vec<u64> = (0..t.points.len()).map(|i| own(i, c)).collect();
        if heights.iter().any(|&b| b > 0) {
            layers.push((c.to_string(), COMPONENT_COLORS[c.index()], heights));
        }
    }
    for (name, color, heights) in layers {
        let above: Vec<u64> = below.iter().zip(&heights).map(|(b, h)| b + h).collect();
        let mut outline: Vec<(f64, f64)> = xs
            .iter()
            .zip(&above)
            .map(|(&x, &y)| (x, y as f64 / GIB))
            .collect();
        outline.extend(
            xs.iter()
                .zip(&below)
                .rev()
                .map(|(&x, &y)| (x, y as f64 / GIB)),
        );
        chart.draw_series(std::iter::once(Polygon::new(outline, color.filled())))?;
        legend.push((name, Mark::Fill(color)));
        below = above;
    }
    // The allocator's cache: reserved above what is allocated.
    let mut cache: Vec<(f64, f64)> = t
        .points
        .iter()
        .enumerate()
        .map(|(i, p)| (i as f64, p.reserved as f64 / GIB))
        .collect();
    let reserved_line = cache.clone();
    cache.extend(
        xs.iter()
            .zip(&below)
            .rev()
            .map(|(&x, &y)| (x, y as f64 / GIB)),
    );
    chart.draw_series(std::iter::once(Polygon::new(cache, CACHE.filled())))?;
    legend.push(("cached: reserved, not allocated".into(), Mark::Fill(CACHE)));
    if plot.outside.iter().any(|&b| b > 0) {
        for (i, phase) in t.phases.iter().enumerate() {
            let bytes = plot.outside.get(i).copied().unwrap_or(0);
            if bytes == 0 || phase.points.is_empty() {
                continue;
            }
            let mut band: Vec<(f64, f64)> = reserved_line[phase.points.clone()]
                .iter()
                .map(|&(x, y)| (x, y + bytes as f64 / GIB))
                .collect();
            band.extend(reserved_line[phase.points.clone()].iter().rev());
            chart.draw_series(std::iter::once(Polygon::new(band, OUTSIDE.filled())))?;
        }
        legend.push((
            "rollout engine, outside the allocator".into(),
            Mark::Fill(OUTSIDE),
        ));
    }
    chart.draw_series(LineSeries::new(reserved_line, RESERVED.stroke_width(2)))?;
    legend.push(("reserved".into(), Mark::Line(RESERVED)));
    if let Some((bytes, name)) = &plot.capacity {
        let y = *bytes as f64 / GIB;
        chart.draw_series(DashedLineSeries::new(
            [(0.0, y), (x_max, y)],
            8,
            5,
            CAPACITY.stroke_width(2),
        ))?;
        legend.push((name.clone(), Mark::Line(CAPACITY)));
    }
    if let Some(i) = t.peak {
        let at = (i as f64, t.points[i].allocated() as f64 / GIB);
        chart.draw_series([
            Circle::new(at, 6, BLACK.stroke_width(2)).into_dyn(),
            // Below the marker: the out-of-memory label sits above the curves.
            annotation("peak", (at.0, at.1 - y_max * 0.09), x_max, y_max, BLACK).into_dyn(),
        ])?;
        legend.insert(0, (plot.peak_label.clone(), Mark::Circle));
    }
    if let Some(oom) = &t.oom {
        let point = &t.points[oom.point];
        let x = oom.point as f64;
        chart.draw_series([
            PathElement::new([(x, 0.0), (x, y_max * 0.93)], CAPACITY.stroke_width(2)).into_dyn(),
            Cross::new(
                (x, point.allocated() as f64 / GIB),
                7,
                CAPACITY.stroke_width(3),
            )
            .into_dyn(),
            annotation("out of memory", (x, y_max * 0.9), x_max, y_max, CAPACITY).into_dyn(),
        ])?;
        legend.insert(0, (oom_label(oom, plot.when), Mark::Cross));
    }
    draw_legend(&legend_area, &legend)
}

/// How a legend entry is drawn.
enum Mark {
    Fill(RGBColor),
    Line(RGBColor),
    /// The peak's marker.
    Circle,
    /// The out-of-memory marker.
    Cross,
    /// A scatter's dot.
    Dot(RGBColor),
}

/// The legend in its own column, long names wrapped, so that it hides no data.
fn draw_legend(
    area: &DrawingArea<SVGBackend, Shift>,
    entries: &[(String, Mark)],
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let font = ("sans-serif", 12).into_font();
    let mut y = 30;
    for (name, mark) in entries {
        let color = match mark {
            Mark::Fill(color) => {
                area.draw(&Rectangle::new([(4, y - 6), (18, y + 6)], color.filled()))?;
                BLACK
            }
            Mark::Line(color) => {
                area.draw(&PathElement::new([(2, y), (20, y)], color.stroke_width(2)))?;
                BLACK
            }
            Mark::Dot(color) => {
                area.draw(&Circle::new((11, y), 5, color.filled()))?;
                BLACK
            }
            Mark::Circle => {
                area.draw(&Circle::new((11, y), 6, BLACK.stroke_width(2)))?;
                BLACK
            }
            Mark::Cross => {
                area.draw(&Cross::new((11, y), 6, CAPACITY.stroke_width(3)))?;
                CAPACITY
            }
        };
        for line in wrap(name, 30) {
            area.draw(&Text::new(line, (26, y - 6), font.clone().color(&color)))?;
            y += 15;
        }
        y += 5;
    }
    Ok(())
}

/// `text` in lines of at most `width` characters, broken at spaces.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in text.split(' ') {
        match lines.last_mut() {
            Some(line) if line.len() + 1 + word.len() <= width => {
                line.push(' ');
                line.push_str(word);
            }
            _ => lines.push(word.to_string()),
        }
    }
    lines
}

/// Bytes outside the allocator at point `i` (see [`TimelinePlot::outside`]).
fn outside_at(plot: &TimelinePlot, i: usize) -> u64 {
    plot.timeline
        .phases
        .iter()
        .position(|p| p.points.contains(&i))
        .and_then(|phase| plot.outside.get(phase).copied())
        .unwrap_or(0)
}

/// The out-of-memory label, worded as `estimate`'s verdict words it.
pub fn oom_label(oom: &headroom::estimate::TimelineOom, when: &str) -> String {
    format!(
        "out of memory in {when} {} ({}), allocating {} ({})",
        oom.step,
        oom.phase,
        oom.tensor,
        gib(oom.requested_bytes)
    )
}

/// A label beside `at`, on the side with room for it.
fn annotation<'a>(
    text: &str,
    at: (f64, f64),
    x_max: f64,
    y_max: f64,
    color: RGBColor,
) -> Text<'a, (f64, f64), String> {
    let font = ("sans-serif", 13).into_font().color(&color);
    let chars = text.chars().count() as f64;
    let width = chars * 7.0 / f64::from(WIDTH - LEGEND_WIDTH - 90) * x_max;
    let x = if at.0 + width * 1.02 < x_max {
        at.0 + x_max * 0.01
    } else {
        (at.0 - width - x_max * 0.01).max(0.0)
    };
    let y = (at.1 + y_max * 0.035).min(y_max * 0.95);
    Text::new(text.to_string(), (x, y), font)
}

/// One line of a line chart.
pub struct Series {
    pub name: String,
    pub color: RGBColor,
    pub points: Vec<(f64, u64)>,
    /// Dots at each point instead of a line (a scatter of configurations).
    pub dots: bool,
}

/// Colours of line charts' series, in order.
pub const SERIES_COLORS: [RGBColor; 4] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xe1, 0x57, 0x59),
];

/// A line chart of byte counts (GiB on the y axis) over `x_desc`, with an optional labelled
/// horizontal line (a GPU's capacity).
pub fn lines_svg(
    title: &str,
    x_desc: &str,
    series: &[Series],
    level: Option<(u64, String)>,
) -> String {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        draw_lines(&root, title, x_desc, series, level.as_ref())
            .expect("drawing into a string does not fail");
        root.present().expect("drawing into a string does not fail");
    }
    svg
}

fn draw_lines(
    root: &DrawingArea<SVGBackend, Shift>,
    title: &str,
    x_desc: &str,
    series: &[Series],
    level: Option<&(u64, String)>,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    let (area, legend_area) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
    let mut legend = Vec::new();
    let all = || series.iter().flat_map(|s| s.points.iter());
    let x_min = all().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let x_max = all().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
    let (x_min, x_max) = if x_min.is_finite() && x_max > x_min {
        (x_min, x_max)
    } else {
        (0.0, 1.0)
    };
    let pad = if series.iter().any(|s| s.dots) {
        (x_max - x_min) * 0.05
    } else {
        0.0
    };
    let y_top = all()
        .map(|p| p.1)
        .chain(level.map(|l| l.0))
        .max()
        .unwrap_or(0)
        .max(1) as f64
        / GIB
        * 1.1;
    let mut chart = ChartBuilder::on(&area)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x_min - pad..x_max + pad, 0f64..y_top)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_desc(x_desc)
        .y_desc("GiB")
        .y_label_formatter(&|v| gib_tick(*v, y_top))
        .x_label_formatter(&|v| {
            if x_max - x_min < 10.0 {
                format!("{v:.2}")
            } else {
                format!("{v:.0}")
            }
        })
        .draw()?;
    // Earlier series are drawn wider under later ones, so lines that coincide all show.
    for (i, s) in series.iter().enumerate() {
        let color = s.color;
        let points = s.points.iter().map(|&(x, y)| (x, y as f64 / GIB));
        if s.dots {
            // Each dot numbered (1, 2, ...) as the table beside the picture numbers its rows.
            chart.draw_series(points.enumerate().map(|(n, p)| {
                EmptyElement::at(p)
                    + Circle::new((0, 0), 5, color.filled())
                    + Text::new(format!("{}", n + 1), (7, -12), ("sans-serif", 12))
            }))?;
            legend.push((s.name.clone(), Mark::Dot(color)));
        } else {
            let width = (2 + 2 * (series.len() - 1 - i)).min(8) as u32;
            chart.draw_series(LineSeries::new(points, color.stroke_width(width)))?;
            legend.push((s.name.clone(), Mark::Line(color)));
        }
    }
    if let Some((bytes, name)) = level {
        let y = *bytes as f64 / GIB;
        chart.draw_series(DashedLineSeries::new(
            [(x_min - pad, y), (x_max + pad, y)],
            8,
            5,
            CAPACITY.stroke_width(2),
        ))?;
        legend.push((name.clone(), Mark::Line(CAPACITY)));
    }
    draw_legend(&legend_area, &legend)
}

/// A tick of a GiB axis, with a decimal where the axis is short.
fn gib_tick(v: f64, top: f64) -> String {
    if top < 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

/// Pictures side by side in one self-contained page: no script, style or font from elsewhere.
fn html(title: &str, svgs: &[String]) -> String {
    let mut page = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\
         <style>body{{font-family:sans-serif;margin:1.5em;color:#222}}\
         .plots{{display:flex;flex-wrap:wrap;gap:1em}}.plots svg{{max-width:100%;height:auto}}\
         </style></head><body><h1>{}</h1>\n",
        escape(title),
        escape(title)
    );
    page += "<div class=\"plots\">\n";
    for svg in svgs {
        page += svg;
        page += "\n";
    }
    page += "</div></body></html>\n";
    page
}

/// Text as HTML and XML read it.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Writes `svgs` to `path`: one SVG as it is (`.svg`), or all in an HTML page (`.html`).
pub fn write(path: &std::path::Path, title: &str, svgs: &[String]) -> crate::error::CliResult {
    use crate::error::CliError;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let content = match ext.as_deref() {
        Some("html" | "htm") => html(title, svgs),
        Some("svg") if svgs.len() == 1 => svgs[0].clone(),
        Some("svg") => {
            return Err(CliError::input(format!(
                "--plot: {} pictures do not fit one SVG file ({}); name an .html file",
                svgs.len(),
                path.display()
            )));
        }
        _ => {
            return Err(CliError::input(format!(
                "--plot: {} is neither .svg nor .html (allowed: FILE.svg, FILE.html)",
                path.display()
            )));
        }
    };
    std::fs::write(path, content)
        .map_err(|e| CliError::failure(format!("cannot write {}: {e}", path.display())))
}

const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// One line of block characters for `values`, resampled to `width` columns (maximum per
/// column) and scaled to `max`.
pub fn sparkline(values: &[u64], width: usize, max: u64) -> String {
    if values.is_empty() || width == 0 {
        return String::new();
    }
    let columns = width.min(values.len());
    (0..columns)
        .map(|c| {
            let start = c * values.len() / columns;
            let end = ((c + 1) * values.len() / columns).max(start + 1);
            let v = values[start..end].iter().copied().max().unwrap_or(0);
            if max == 0 {
                BARS[0]
            } else {
                let level = (v as f64 / max as f64 * (BARS.len() - 1) as f64).round() as usize;
                BARS[level.min(BARS.len() - 1)]
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparkline_scales_to_the_maximum() {
        assert_eq!(sparkline(&[0, 50, 100], 3, 100), "▁▅█");
        // two values per column: the column shows their maximum
        assert_eq!(sparkline(&[0, 100, 0, 0], 2, 100), "█▁");
        assert_eq!(sparkline(&[], 10, 1), "");
    }

    #[test]
    fn a_line_chart_is_xml_with_its_series_and_an_escaped_title() {
        let series = [Series {
            name: "reserved".into(),
            color: SERIES_COLORS[0],
            points: vec![(0.0, 1 << 30), (9.0, 2 << 30)],
            dots: false,
        }];
        let svg = lines_svg(
            "a<b & c",
            "trace entry",
            &series,
            Some((3 << 30, "H100".into())),
        );
        let doc = roxmltree::Document::parse(&svg).expect("valid XML");
        let texts: Vec<&str> = doc
            .descendants()
            .filter_map(|n| n.text())
            .map(str::trim)
            .collect();
        assert!(texts.contains(&"a<b & c"), "{texts:?}");
        assert!(texts.contains(&"reserved") && texts.contains(&"H100"));
        // an empty chart still draws
        roxmltree::Document::parse(&lines_svg("none", "x", &[], None)).expect("valid XML");
    }
}
