"""The demo's plot keeps every mark visible when detection and remediation fall on the same second."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from adpfleet.demo import draw_marks  # noqa: E402


def test_marks_on_the_same_second_stay_distinct_lines_with_labels_at_their_own_heights():
    fig, ax = plt.subplots()
    ax.plot([0, 60], [0, 100])
    draw_marks(ax, [("fault", 12.0), ("detected", 21.0), ("remediation", 21.0)])
    lines = [line for line in ax.get_lines() if line.get_label() in ("fault", "detected", "remediation")]
    assert [line.get_label() for line in lines] == ["fault", "detected", "remediation"]
    same_second = lines[1:]
    assert same_second[0].get_linestyle() != same_second[1].get_linestyle()
    assert same_second[0].get_color() != same_second[1].get_color()
    assert same_second[0].get_linewidth() > same_second[1].get_linewidth()  # the later one drawn inside the first
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.texts]
    assert [t.get_text() for t in ax.texts] == ["fault 12 s", "detected 21 s", "remediation 21 s"]
    assert not boxes[1].overlaps(boxes[2])  # the two labels of one second do not cover each other
    plt.close(fig)


def test_a_mark_that_did_not_happen_is_left_out():
    fig, ax = plt.subplots()
    draw_marks(ax, [("fault", 5.0), ("detected", None), ("remediation", None)])
    assert [line.get_label() for line in ax.get_lines()] == ["fault"]
    plt.close(fig)
