//! The E2B code-interpreter SDK, unmodified, on its default template (`code-interpreter-v1`,
//! bud's `datascience`: numpy, pandas, matplotlib): figures, DataFrames with their data,
//! charts, display() of frames and figures, and the template's warm kernel in a sandbox's
//! first code context. A binary of its own, apart from `compat.rs` (whose clients run on the
//! `python` template), so that in the suite only this waits for the `datascience` template's
//! build, the longest of the chain. The client venv is `compat.rs`'s
//! (`<repo>/build/compat-venv`, made once under its lock by whichever binary comes first).
//! Needs /dev/kvm and PyPI; the first run builds and boots the datascience template.

mod common;

use bud_server::Config;
use common::clients::{client_script, e2b_env};
use common::*;
use serde_json::{Value, json};

#[test]
fn the_e2b_sdk_shows_figures_frames_and_charts_on_its_default_template() {
    let mut config: Config = test_config();
    config.templates = vec!["datascience".into()];
    let s = TestServer::with_config(config);
    let seen = client_script("e2b_figures.py", &[], &e2b_env(&s, "e2b_any"));
    // E2B shows a string's repr without its quotes.
    assert_eq!(seen["figure"], json!([2, true, false, "done", true]));
    assert_eq!(
        seen["frame"],
        json!([true, ["a", "b", "0", "1", "3", "1", "2", "4"]])
    );
    assert_eq!(
        seen["frame_data"],
        json!([
            1,
            true,
            {"n": [1, 2], "x": [0.5, null], "s": ["p", "q"],
             "t": ["2024-01-01T00:00:00", "2024-01-02T03:04:05"]},
            ["data", "html", "text"]
        ])
    );
    // In the frame's order (the server does not re-sort the keys).
    assert_eq!(seen["frame_columns"], json!(["n", "x", "s", "t"]));
    assert_eq!(seen["big_frame"], json!([10000, 9999.0]));
    let figure = |chart: Value| -> Value {
        let mut row = json!([false, "<Figure size 640x480 with 1 Axes>", true]);
        row.as_array_mut()
            .unwrap()
            .extend(chart.as_array().unwrap().iter().cloned());
        row
    };
    assert_eq!(
        seen["charts"],
        json!([
            figure(json!([
                "LineChart",
                "line",
                "growth",
                "time (s)",
                "size [m]",
                "s",
                "m",
                [
                    ["squares", [[1.0, 1.0], [2.0, 4.0], [3.0, 9.0]]],
                    ["Line 1", [[1.0, 2.0], [2.0, 3.0], [3.0, 4.0]]]
                ],
                ["linear", [0.75, 1.0], ["0.75", "1.00"]]
            ])),
            figure(json!([
                "BarChart",
                "bar",
                "bars",
                null,
                null,
                null,
                null,
                [
                    ["a", "counts", 3.0],
                    ["b", "counts", 1.0],
                    ["c", "counts", 2.0]
                ]
            ])),
            figure(json!([
                "ScatterChart",
                "scatter",
                null,
                null,
                null,
                null,
                null,
                [["dots", [[1.0, 5.0], [2.0, 6.0]]]],
                ["linear", [0.8, 1.0], ["0.8", "1.0"]]
            ])),
            [true, "value", false],
            // Left open: after the value. Horizontal bars: x and y swapped, so that y is
            // the value axis, as E2B has it.
            figure(json!([
                "BarChart",
                "bar",
                null,
                null,
                "amount (kg)",
                null,
                "kg",
                [["p", "Group 0", 7.0], ["q", "Group 0", 8.0]]
            ])),
        ])
    );
    assert_eq!(
        seen["display"],
        json!([
            [false, "shown", ["text"]],
            [false, "   n\ni  1\nj  2", ["data", "html", "text"]],
            [false, "{'k': 1}", ["text"]],
            [false, "<Figure size 640x480 with 1 Axes>", ["chart", "png", "text"]],
            [false, "{'k': [1, 2]}", ["json", "text"]],
            [true, "42", ["text"]],
            ["printed\n"],
            {"n": [1, 2]}
        ])
    );
    eprintln!("E2B cell wall times (datascience), s: {}", seen["timings"]);
    // The first context has the template's warm kernel (pandas imported); the next a new
    // one.
    assert_eq!(seen["kernel"], json!([true, true]));
    assert_eq!(seen["fresh_kernel"], json!([true, false]));
    assert_eq!(seen["async_frame"], json!({"n": [1, 2]}));
    assert_eq!(
        s.state.sessions().count(),
        0,
        "the sandboxes' sessions are gone"
    );
}
