from benchmarks.sections import s8_async_checkpoint


def test_measure_and_render_the_tiny_shape(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the section writes under runs/
    results = s8_async_checkpoint.measure(s8_async_checkpoint.QUICK_SHAPES, log=lambda line: None)
    (result,) = results
    repeats = s8_async_checkpoint.QUICK_SHAPES[0].repeats
    assert {arm: len(times) for arm, times in result.seconds.items()} == {
        "sync": repeats, "async": repeats, "behind": repeats}
    assert result.checkpoint_mb > 0 and result.parameters > 0
    text = s8_async_checkpoint.render(results, "1.00 / 1.00 / 1.00")
    assert "| tiny (1 layer, width 16, block 8) |" in text
    assert text.count("\n|") == 3  # the header, its rule and one row
    assert list((tmp_path / "runs").iterdir()) == []  # the checkpoints went with their folder
