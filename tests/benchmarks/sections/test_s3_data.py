import torch

from benchmarks.sections import s3_data
from benchmarks.sections.s4_epoch import synthetic_images


def test_torchvision_pipeline_yields_normalised_cifar_tensors():
    images, labels = synthetic_images(4)
    dataset = s3_data.PilImages(images, labels, s3_data.torchvision_transform())
    x, y = dataset[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert y == labels[0].item()
    assert x.min() < 0 < x.max()  # normalised around the CIFAR-10 mean


def test_steady_images_per_second_leaves_the_first_batch_out():
    seen = []

    def batches():
        for index in range(4):
            seen.append(index)
            yield torch.zeros(8, 3, 32, 32), torch.zeros(8)

    rate = s3_data.steady_images_per_second(batches(), timed=2)
    assert seen == [0, 1, 2] and rate > 0


def test_measure_and_render_every_pipeline():
    images, labels = synthetic_images(3 * 4)
    result = s3_data.measure(images, labels, batch_size=4, timed=2, repeats=1,
                             log=lambda line: None)
    assert set(result.images_per_second) == {
        s3_data.OURS, "torchvision, 0 workers", "torchvision, 2 workers"}
    share = s3_data.FetchShare("run", [0.01], [1.0])
    text = s3_data.render(result, [share], threads=1)
    assert "| run | 10.0 | 1000 | 1.0 |" in text
