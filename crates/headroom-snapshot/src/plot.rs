//! Pictures of a trace: a terminal sparkline and an SVG timeline. Both are written by hand:
//! nothing here needs a font or a plotting library.

use std::fmt::Write as _;

use headroom_alloc::format_size;

use crate::summary::TimelinePoint;

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

/// An SVG line chart of active and reserved bytes over the trace entries.
pub fn timeline_svg(title: &str, timeline: &[TimelinePoint]) -> String {
    const WIDTH: f64 = 960.0;
    const HEIGHT: f64 = 360.0;
    const LEFT: f64 = 90.0;
    const RIGHT: f64 = 20.0;
    const TOP: f64 = 40.0;
    const BOTTOM: f64 = 50.0;
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let max_y = timeline
        .iter()
        .map(|p| p.reserved_bytes.max(p.active_bytes))
        .max()
        .unwrap_or(0)
        .max(1);
    let max_x = timeline.last().map_or(1, |p| p.event_index.max(1));
    let x = |i: usize| LEFT + i as f64 / max_x as f64 * plot_w;
    let y = |v: u64| TOP + plot_h - v as f64 / max_y as f64 * plot_h;
    let line = |value: fn(&TimelinePoint) -> u64| {
        timeline
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.event_index), y(value(p))))
            .collect::<Vec<_>>()
            .join(" ")
    };

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="22" font-size="14">{}</text>"#,
        escape(title)
    );
    for tick in 0..=4 {
        let v = max_y / 4 * tick;
        let ty = y(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{ty:.1}" x2="{:.1}" y2="{ty:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            ty + 4.0,
            escape(&format_size(v))
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">trace entry (0 – {max_x})</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 15.0
    );
    let _ = writeln!(
        svg,
        r##"<polyline fill="none" stroke="#f28e2c" stroke-width="1.5" points="{}"/>"##,
        line(|p| p.reserved_bytes)
    );
    let _ = writeln!(
        svg,
        r##"<polyline fill="none" stroke="#4e79a7" stroke-width="1.5" points="{}"/>"##,
        line(|p| p.active_bytes)
    );
    let _ = writeln!(
        svg,
        r##"<text x="{:.1}" y="22" fill="#f28e2c" text-anchor="end">reserved</text><text x="{:.1}" y="22" fill="#4e79a7" text-anchor="end">active (requested bytes)</text>"##,
        WIDTH - RIGHT,
        WIDTH - RIGHT - 70.0
    );
    svg.push_str("</svg>\n");
    svg
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
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
    fn svg_has_both_series_and_escapes_the_title() {
        let points = [
            TimelinePoint {
                event_index: 0,
                time_us: 0,
                active_bytes: 10,
                reserved_bytes: 20,
            },
            TimelinePoint {
                event_index: 9,
                time_us: 1,
                active_bytes: 5,
                reserved_bytes: 20,
            },
        ];
        let svg = timeline_svg("a<b", &points);
        assert!(svg.starts_with("<svg"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a&lt;b"));
    }
}
