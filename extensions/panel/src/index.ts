/**
 * workbench-panel: a JupyterLab side panel for the active notebook's fleet.
 */

import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { LabIcon } from '@jupyterlab/ui-components';

import { WorkbenchPanel } from './panel';

const ICON = new LabIcon({
  name: 'workbench:fleet',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
    '<rect x="3" y="4" width="8" height="7" rx="1"/><rect x="13" y="4" width="8" height="7" rx="1"/>' +
    '<rect x="3" y="13" width="8" height="7" rx="1"/><rect x="13" y="13" width="8" height="7" rx="1"/></g></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'workbench-panel:plugin',
  description: 'Side panel for a workbench fleet: engines, live metrics, checkpoints',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILayoutRestorer, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null
  ) => {
    const panel = new WorkbenchPanel(tracker);
    panel.title.icon = ICON;
    app.shell.add(panel, 'right', { rank: 600 });
    if (restorer) {
      restorer.add(panel, 'workbench-panel');
    }
    app.commands.addCommand('workbench:open-panel', {
      label: 'Show the workbench fleet panel',
      execute: () => app.shell.activateById(panel.id)
    });
    palette?.addItem({ command: 'workbench:open-panel', category: 'workbench' });
  }
};

export default plugin;
