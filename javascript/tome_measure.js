// Settings > ToMe > "Measure now": POST /tome/measure and show the table and plot it returns.
async function tomeMeasureNow(button) {
    const out = gradioApp().querySelector("#tome_measure_result");
    button.disabled = true;
    out.innerHTML = "<p>ToMe: measuring (the console shows each size)...</p>";
    try {
        const answer = await fetch("./tome/measure", {method: "POST"});
        const data = await answer.json();
        out.innerHTML = answer.ok ? data.html : `<p>ToMe: ${answer.status} ${JSON.stringify(data)}</p>`;
    } catch (e) {
        out.innerHTML = `<p>ToMe: ${e}</p>`;
    } finally {
        button.disabled = false;
    }
}
